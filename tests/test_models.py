import hashlib
import time

import pytest
import torch

from pace_bench import models


def _greedy(model, tok, text, max_new_tokens=8):
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def smollm2():
    t0 = time.perf_counter()
    model, tok = models.load_model("smollm2-135m")
    print(f"smollm2-135m load: {time.perf_counter() - t0:.1f}s")
    return model, tok


def test_smollm2_loads_and_generates(smollm2):
    model, tok = smollm2
    assert not model.training
    assert model.dtype == models.preferred_dtype()  # the dtype this machine runs fast, never a fixed one
    text = _greedy(model, tok, "Say hello.", max_new_tokens=5)
    assert isinstance(text, str) and text.strip()


def test_dense_cache_matches_gguf(smollm2):
    """The safetensors copy in the cache holds the same weights as a fresh GGUF load."""
    model, tok = smollm2
    ref, ref_tok = models.load_model("smollm2-135m", use_dense_cache=False)
    ids = torch.tensor([tok.encode("def fee_for(order): return 1")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    text = "class Order:\n    order_id: int  # <|im_end|>"
    assert tok.encode(text) == ref_tok.encode(text)
    assert tok.chat_template == ref_tok.chat_template
    assert tok.eos_token == ref_tok.eos_token


def _fake_spec(tmp_path, payloads, expected):
    src = tmp_path / "src"
    src.mkdir()
    parts = []
    for i, data in enumerate(payloads):
        (src / f"part{i:02d}.bin").write_bytes(data)
        parts.append(models.WheelPart(f"fake-part{i}==0", f"fake_part{i}", f"part{i:02d}.bin"))
    spec = models.SplitGGUF(
        filename="fake.gguf", size=len(expected), sha256=hashlib.sha256(expected).hexdigest(), parts=tuple(parts)
    )
    return spec, src


@pytest.fixture
def fake_parts(monkeypatch, tmp_path):
    def install(payloads, expected):
        spec, src = _fake_spec(tmp_path, payloads, expected)
        monkeypatch.setitem(models.MODELS, "fake-model", spec)
        monkeypatch.setattr(models, "_locate_part", lambda part: src / part.relpath)

        def no_pip(reqs):  # pragma: no cover - must never run in these tests
            raise AssertionError(f"pip called for {reqs}")

        monkeypatch.setattr(models, "_pip_install", no_pip)
        return spec

    return install


def test_reassembly_ok(fake_parts, tmp_path, capsys):
    fake_parts([b"GGUF" + b"a" * 100, b"b" * 50, b"c"], b"GGUF" + b"a" * 100 + b"b" * 50 + b"c")
    cache = tmp_path / "cache"
    d, f = models.resolve_gguf("fake-model", cache_dir=cache)
    assert (cache / f).read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 50 + b"c"
    assert d == str(cache)
    said = capsys.readouterr().err  # a first load says what it writes, and where
    assert "reassembling fake.gguf" in said and str(cache) in said and "PACE_HF_CACHE" in said
    # A second call reuses the verified file, silently.
    assert models.resolve_gguf("fake-model", cache_dir=cache) == (d, f)
    assert capsys.readouterr().err == ""


def test_hash_mismatch_raises_and_leaves_no_file(fake_parts, tmp_path):
    # Same size, one byte different: only the sha256 catches it.
    fake_parts([b"GGUF" + b"a" * 100, b"X" * 50], b"GGUF" + b"a" * 100 + b"b" * 50)
    cache = tmp_path / "cache"
    with pytest.raises(models.GGUFIntegrityError, match="sha256"):
        models.resolve_gguf("fake-model", cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_size_mismatch_raises(fake_parts, tmp_path):
    fake_parts([b"GGUF", b"short"], b"GGUF" + b"longer-than-that")
    with pytest.raises(models.GGUFIntegrityError, match="bytes"):
        models.resolve_gguf("fake-model", cache_dir=tmp_path / "c")
    assert list((tmp_path / "c").iterdir()) == []


def test_damaged_cached_file_is_rebuilt(fake_parts, tmp_path):
    expected = b"GGUF" + b"z" * 64
    fake_parts([expected[:10], expected[10:]], expected)
    cache = tmp_path / "cache"
    d, f = models.resolve_gguf("fake-model", cache_dir=cache)
    (cache / f).write_bytes(b"GGUF" + b"y" * 64)  # same size, wrong content, stamp now stale
    models.resolve_gguf("fake-model", cache_dir=cache)
    assert (cache / f).read_bytes() == expected


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PACE_HF_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path
    assert models.cache_root(tmp_path / "x") == tmp_path / "x"


@pytest.mark.slow
def test_qwen_default_loads_and_answers():
    t0 = time.perf_counter()
    model, tok = models.load_model()
    print(f"qwen2.5-coder-0.5b load: {time.perf_counter() - t0:.1f}s")
    assert model.config.model_type == "qwen2"
    assert model.config.num_hidden_layers == 24
    text = _greedy(model, tok, "What is 2 + 3? Answer with the number only.", max_new_tokens=6)
    assert "5" in text


_KEEP_DENSE_RANK = """
import sys
from pathlib import Path
import torch
import torch.distributed as dist
from tokenizers import Tokenizer, models as tm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from pace_bench.models import _keep_dense

dist.init_process_group("gloo", init_method="env://")
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1))
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tm.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
kept = _keep_dense(model, tokenizer, {"rank": dist.get_rank()}, Path(sys.argv[1]) / f"dense{dist.get_rank()}")
print("kept" if kept else "not kept")
dist.destroy_process_group()
"""


def test_dense_copy_is_kept_whole_or_not_at_all_under_distributed(tmp_path):
    """Under accelerate's processes transformers writes a model's files on rank 0 only: another rank's
    save must keep nothing, not a copy with a tokenizer and no weights that every later load trips on."""
    import os
    import socket
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    script = tmp_path / "rank.py"
    script.write_text(_KEEP_DENSE_RANK)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
             for rank in (0, 1)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["kept", "not kept"]
    assert not (tmp_path / "dense1").exists() and not list(tmp_path.glob("*.partial"))
    AutoModelForCausalLM.from_pretrained(tmp_path / "dense0")  # rank 0's copy is whole
