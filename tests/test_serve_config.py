"""pace-serve serves what the model's generation config asks for, or refuses to start; a burst leaves no peak.

- The model's ``generation_config.repetition_penalty`` applies in the batched decode as ``generate``
  applies it (over the prompt and the reply so far): the batched engine's greedy fp32 replies equal the
  one-turn-at-a-time engine's, which runs ``generate``.
- A generation config whose logits processor the batched decode does not apply (``no_repeat_ngram_size``)
  stops ``pace-serve`` at startup with the field's name; ``--no-batch-decode`` (``generate``) takes it.
- After a burst of concurrent turns, a real server's resident memory comes back within 10% of what it
  held idle (glibc keeps freed memory in its arenas unless trimmed).
"""

import copy
import shutil
import time

import pytest

from test_serve import Server, tiny_dir  # noqa: F401 - tiny_dir is a fixture
from test_serve_batch import run_turns, together

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

PROMPTS = ["Session one: define class Ledger with owner and balance. " * 3,
           "Session two: the weather in Lyon, in three words.",
           "Session three: " + "settle the records, then sum the amounts. " * 6]


def engine_with(tiny_dir, tmp_path, batch_decode, **config):  # noqa: F811
    import torch
    import transformers as tf

    from pace_hf import HostTier, TieredStore
    from pace_hf.serve.engine import Engine

    path, tokenizer = tiny_dir
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config = copy.deepcopy(model.generation_config)
    for name, value in config.items():
        setattr(model.generation_config, name, value)
    return Engine(model, tokenizer, TieredStore([HostTier(1 << 30)]), "tiny", max_context=1024, max_resident=6,
                  max_batch=4, batch_decode=batch_decode)


def replies(engine):
    engine.start()
    try:
        out = run_turns(engine, [(f"s{i}", [("user", p)], 24) for i, p in enumerate(PROMPTS)])
    finally:
        engine.close()
    assert all(kind == "done" for kind, _ in out), out
    return [payload["content"] for _, payload in out]


def test_the_models_repetition_penalty_applies_batched_as_in_generate(tiny_dir, tmp_path):  # noqa: F811
    penalized = replies(engine_with(tiny_dir, tmp_path, True, repetition_penalty=1.8))
    assert penalized == replies(engine_with(tiny_dir, tmp_path, False, repetition_penalty=1.8))
    assert penalized != replies(engine_with(tiny_dir, tmp_path, True)), "the penalty changed nothing here"


def test_a_processor_the_batched_decode_does_not_apply_stops_the_server_by_name(tiny_dir, tmp_path):  # noqa: F811
    from pace_hf.serve.__main__ import main

    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        engine_with(tiny_dir, tmp_path, True, no_repeat_ngram_size=3)
    engine_with(tiny_dir, tmp_path, False, no_repeat_ngram_size=3).store.close()  # generate applies it
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dir[0], model_dir)
    import transformers as tf

    config = tf.GenerationConfig.from_pretrained(model_dir)
    config.no_repeat_ngram_size, config.suppress_tokens = 3, [5]
    config.save_pretrained(model_dir)
    with pytest.raises(SystemExit) as stopped:
        main(["--model", str(model_dir), "--store", f"disk:{tmp_path / 'kv'}", "--dtype", "float32"])
    assert "no_repeat_ngram_size, suppress_tokens" in str(stopped.value)
    assert "--no-batch-decode" in str(stopped.value)


def rss(pid):
    return psutil.Process(pid).memory_info().rss


def test_memory_after_a_burst_comes_back_within_a_tenth_of_idle(tiny_dir, tmp_path):  # noqa: F811
    srv = Server(tiny_dir[0], tmp_path / "store", "--max-context", "4096", "--max-resident", "4",
                 "--max-batch", "4", "--queue-size", "32")
    try:
        client = srv.client()
        warm = [{"role": "user", "content": "Warm up: " + PROMPTS[2]}]
        client.chat.completions.create(model=srv.name, messages=warm, max_tokens=8)
        time.sleep(2)  # its save lands, the worker trims
        idle = rss(srv.proc.pid)
        text = " ".join(f"record {i} settles amount {i * 7} to account {i % 13}." for i in range(60))
        calls = [lambda i=i: client.chat.completions.create(
            model=srv.name, messages=[{"role": "user", "content": f"Burst {i}: {text}"}], max_tokens=16)
            for i in range(8)]
        together(*calls)
        peak = rss(srv.proc.pid)
        deadline = time.time() + 30
        while rss(srv.proc.pid) > 1.1 * idle and time.time() < deadline:
            time.sleep(0.5)
        after = rss(srv.proc.pid)
        assert after <= 1.1 * idle, (f"idle {idle / 2**20:.0f} MiB, after the burst {peak / 2**20:.0f} MiB, "
                                     f"30 s later {after / 2**20:.0f} MiB")
    finally:
        srv.stop()
