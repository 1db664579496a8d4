"""bench/perplexity.py on a tiny random model saved beside a real tokenizer: the streamed full cache gives
the one-forward NLL, the evicting arms run under the same tokens, and --resume (the suite skeleton's)
keeps what is done."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from pace_bench.models import load_tokenizer

SCRIPT = Path(__file__).parent.parent / "bench" / "perplexity.py"


@pytest.fixture(scope="module")
def ppl():
    spec = importlib.util.spec_from_file_location("perplexity", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = load_tokenizer("smollm2-135m")
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_streamed_full_cache_is_the_one_forward_nll_and_arms_run(ppl, model_dir, tmp_path):
    out = tmp_path / "out"
    args = ["--model", str(model_dir), "--tokens", "600", "--chunk", "128", "--budget", "160", "--limit", "400",
            "--bin", "200", "--dtype", "float32", "--out", str(out)]
    assert ppl.main(args + ["--arms", "full,h2o"]) == 0
    records = {r["arm"]: r for r in map(json.loads, (out / "probes.jsonl").read_text().splitlines())}
    assert set(records) == {"full", "h2o"} and (out / "ppl.png").stat().st_size > 0
    full = records["full"]
    assert [b["tokens"] for b in full["bins"]] == [199, 200, 200]  # 599 predicted tokens
    model, tokenizer = __import__("pace_bench.models", fromlist=["load_model"]).load_model(str(model_dir), dtype=torch.float32)
    ids = ppl.prose(tokenizer, 600)
    with torch.no_grad():
        logits = model(ids).logits[0, :-1]
    expected = torch.nn.functional.cross_entropy(logits.float(), ids[0, 1:]).item()
    assert math.isclose(math.log(full["ppl"]), expected, rel_tol=1e-4)
    assert records["h2o"]["ppl"] != full["ppl"]  # it evicted
    # --resume plays only the new arm
    assert ppl.main(args + ["--arms", "full,h2o,pace", "--resume"]) == 0
    lines = (out / "probes.jsonl").read_text().splitlines()
    assert [json.loads(line)["arm"] for line in lines] == ["full", "h2o", "pace"]
    text = (out / "table.md").read_text()
    assert "| ratio to full |" in text and "| ratio to h2o |" in text and "| CPU seconds |" in text
    assert all(json.loads(line)["cpu_seconds"] > 0 for line in lines)
    with pytest.raises(SystemExit, match="other budget"):  # a resume with other settings would mix two runs
        ppl.main([a if a != "160" else "192" for a in args] + ["--arms", "full", "--resume"])


def test_every_arm_streams_code_and_retrieval_restores_pages(ppl, model_dir, tmp_path):
    """The StreamingLLM arms and PACE with retrieval run on standard-library code; retrieval restores
    evicted pages (its query is the chunk already read) and so predicts differently from plain PACE."""
    out = tmp_path / "out"
    args = ["--model", str(model_dir), "--text", "code", "--tokens", "1536", "--chunk", "256", "--budget", "192",
            "--limit", "640", "--bin", "512", "--dtype", "float32", "--out", str(out),
            "--arms", "streaming,streaming_bounded,pace,pace_retrieval"]
    assert ppl.main(args) == 0
    records = {r["arm"]: r for r in map(json.loads, (out / "probes.jsonl").read_text().splitlines())}
    assert all(r["text"] == "code" and math.isfinite(r["ppl"]) for r in records.values())
    assert records["pace_retrieval"]["retrieval_tokens_restored"] > 0
    assert records["pace_retrieval"]["ppl"] != records["pace"]["ppl"]
    assert "standard-library code" in (out / "table.md").read_text()


def test_bad_arguments_are_refused_before_loading(ppl, tmp_path):
    with pytest.raises(SystemExit):
        ppl.main(["--arms", "full,nope", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        ppl.main(["--budget", "1024", "--chunk", "2048", "--limit", "2048", "--out", str(tmp_path)])
