"""A prefill that survives restarts (issue 26 item 3): saves every N prefill chunks, a real SIGKILL in
the middle, and a resume that gives exactly the tokens of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_runner import _tiny_model_dir
from tiny_models import tiny_model

from pace_bench import runner
from pace_bench.checkpoint import read_chunk_log
from pace_hf import PACECache, PACESession
from pace_hf.session import generate_reply
from pace_hf.tiers import DiskTier, TieredStore

REPO = Path(__file__).resolve().parents[1]
CONTEXT = " ".join(f"item{i} = {i * 7 % 13}" for i in range(120))  # a long user turn (~800 tokens)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def _load(model_dir):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_dir).eval(), tf.AutoTokenizer.from_pretrained(model_dir)


def _kill_at_first_save(cmd, root: Path, env=None, timeout=120):
    """Start ``cmd``; SIGKILL it as soon as a save's manifest is in ``root`` (a real kill, mid-prefill)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while not any(root.rglob("*manifest*")):
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the process ended (rc {proc.returncode}) before its first save:\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no save within the timeout")
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


# -- generate_reply: segments of whole chunks, the same forwards ---------------------------------------


def test_checkpointed_prefill_runs_the_same_forwards_and_resumes_to_the_same_tokens(tmp_path):
    """Saves every 3 chunks; the cache after it is bit-identical to one generate's, and a cache resumed
    from the last save (in this process: the kill is below) answers with the same tokens."""
    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    kwargs = dict(max_new_tokens=12, stop_ids=[0], chunk=40)
    plain = PACECache(model=model, budget=160, limit=256)
    expected = generate_reply(model, ids, plain, **kwargs)
    store = TieredStore([DiskTier(tmp_path / "kv")])
    cache = PACECache(model=model, budget=160, limit=256, store=store, session_id="s")
    seen = []

    def save():
        seen.append(cache.get_seq_length())
        cache.save()

    assert generate_reply(model, ids, cache, checkpoint_every=3, checkpoint=save, **kwargs) == expected
    assert seen == [120, 240, 360]  # whole segments of 3 chunks, the last token left to generate
    for a, b in zip(plain.layers, cache.layers):
        assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))
    assert cache.renumbers == plain.renumbers
    # resume the last save (at 360 tokens) and answer: the uninterrupted tokens
    resumed = PACECache.resume("s", store=store, model=model)
    assert resumed.get_seq_length() == 360
    assert generate_reply(model, ids, resumed, **kwargs) == expected
    store.close()


def test_checkpoint_arguments_are_checked():
    model = tiny_model("qwen2")
    cache = PACECache(model=model, budget=160, limit=256)
    ids = list(range(3, 200))
    with pytest.raises(ValueError, match="needs a prefill chunk size"):
        generate_reply(model, ids, cache, max_new_tokens=1, stop_ids=[0], checkpoint_every=2, checkpoint=cache.save)
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1"):
        generate_reply(model, ids, cache, max_new_tokens=1, stop_ids=[0], chunk=32, checkpoint_every=0,
                       checkpoint=cache.save)
    with pytest.raises(TypeError, match="needs checkpoint="):
        generate_reply(model, ids, cache, max_new_tokens=1, stop_ids=[0], chunk=32, checkpoint_every=2)
    assert cache.get_seq_length() == 0  # nothing ran


# -- play_session: a pair interrupted at any save resumes to the same record ------------------------------


def test_a_pair_stopped_at_any_save_resumes_to_the_same_records(tmp_path, monkeypatch, code_eval_allowed):
    """Rehydration on, no plan: saves land in the history prefill of probe 1, in its own prompt, and in
    probe 2's prompt (with probe 1's record in the state). Stopped at each of them and resumed, the pair
    gives exactly the uninterrupted records."""
    import evaluate

    from pace_bench import build_session
    from pace_bench.arms import ArmSettings
    from pace_bench.build import SYSTEM_PROMPT
    from pace_bench.checkpoint import STATE_KEY
    from pace_bench.models import load_tokenizer
    from pace_hf import Blueprint
    from pace_hf.memory import persist
    from pace_hf.chat import ChatTemplate
    from pace_bench.metrics import PACE_CODING

    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    metric = evaluate.load(PACE_CODING)  # the real metric: answers run in its sandbox
    tok = load_tokenizer("smollm2-135m")
    row = build_session(tok, seed=0, total_tokens=900, distance=300, secret="c4ec" * 8)  # a fixed session
    row["probes"] = row["probes"][:2]
    model = tiny_model("qwen2", vocab_size=len(tok))
    stop_ids = ChatTemplate(tok, SYSTEM_PROMPT).stop_ids()
    same = ("probe", "answer", "residency", "rotary_gap", "rehydrated_tokens", "peak_cache_bytes", "full_cache_bytes")

    def play(store, **kw):
        records = runner.play_session(model, tok, row, "pace", ArmSettings(budget=256, limit=640), metric, 16,
                                      stop_ids, 6, blueprint=Blueprint(), store=store, rehydrate=True, **kw)
        return [{k: r.get(k) for k in same} for r in records]

    plain_store = TieredStore([DiskTier(tmp_path / "plain", fsync=False)])
    expected = play(plain_store)
    assert expected[0]["rehydrated_tokens"] > 0  # the history's prefill evicted the definition
    real, phases = persist.save, []

    def recording(cache, attachments=None):
        phases.append((attachments[STATE_KEY][1]["probe"], attachments[STATE_KEY][1]["phase"]))
        return real(cache, attachments)

    monkeypatch.setattr(persist, "save", recording)
    store = TieredStore([DiskTier(tmp_path / "kv", fsync=False)])  # a stop, not a power cut: no fsync needed
    assert play(store, checkpoint_every=1) == expected  # saving changes nothing
    assert {(0, "history"), (0, "probe"), (1, "probe")} <= set(phases)
    stops = [phases.index(p) + 1 for p in ((0, "history"), (0, "probe"), (1, "probe"))]
    for stop in stops:
        calls = []

        def stopping(cache, attachments=None):
            calls.append(real(cache, attachments))
            if len(calls) == stop:
                raise KeyboardInterrupt  # a stop right after save number `stop`
            return calls[-1]

        monkeypatch.setattr(persist, "save", stopping)
        with pytest.raises(KeyboardInterrupt):
            play(store, checkpoint_every=1)
        monkeypatch.setattr(persist, "save", real)
        assert play(store, checkpoint_every=1, resume=True) == expected, f"stopped after save {stop}"
    plain_store.close()
    store.close()


# -- PACESession.generate(checkpoint_every=N), killed mid-prefill ---------------------------------------


def test_session_killed_mid_prefill_resumes_from_its_checkpoint_to_the_same_reply(model_dir, tmp_path):
    root = tmp_path / "kv"
    script = tmp_path / "session_run.py"
    script.write_text(textwrap.dedent(f"""
        import transformers as tf
        from pace_hf import PACESession
        from pace_hf.tiers import DiskTier, TieredStore

        model = tf.AutoModelForCausalLM.from_pretrained({model_dir!r}).eval()
        tok = tf.AutoTokenizer.from_pretrained({model_dir!r})
        session = PACESession(model, tok, budget=256, limit=1024, chunk=64, store=TieredStore([DiskTier({str(root)!r})]),
                              session_id="agent")
        session.add("user", {CONTEXT!r})
        session.generate(max_new_tokens=8, checkpoint_every=2)
    """))
    _kill_at_first_save([sys.executable, str(script)], root)

    model, tok = _load(model_dir)
    plain = PACESession(model, tok, budget=256, limit=1024, chunk=64)
    plain.add("user", CONTEXT)
    expected = plain.generate(max_new_tokens=8)
    store = TieredStore([DiskTier(root)])
    session = PACESession.resume("agent", model, tok, store=store)
    at = session.cache.get_seq_length()
    assert 0 < at < len(session.ids) and at % 128 == 0  # mid-prefill, on a segment boundary
    assert [m.content for m in session.messages] == [CONTEXT]  # the turn, not yet answered
    assert session.generate(max_new_tokens=8) == expected
    assert session.ids == plain.ids
    with pytest.raises(ValueError, match="needs a session with a store"):
        plain.generate(max_new_tokens=1, checkpoint_every=2)
    store.close()


# -- pace-bench --checkpoint-every N, killed mid-prefill, then --resume ------------------------------------


def _bench_args(model_dir, out):
    return ["--model", model_dir, "--arms", "pace", "--sessions", "1", "--tokens", "1200", "--budget", "256",
            "--limit", "1024", "--chunk", "64", "--max-new-tokens", "4", "--no-progress", "--store", "disk",
            "--checkpoint-every", "2", "--chunk-log", "--secret", "c0ffee" * 6, "--out", str(out)]  # the same sessions


def test_bench_killed_mid_prefill_resumes_from_its_checkpoint_to_the_same_answers(model_dir, tmp_path, capsys,
                                                                                   code_eval_allowed):
    base, run = tmp_path / "base", tmp_path / "run"
    assert runner.main(_bench_args(model_dir, base)) == 0
    expected = [json.loads(line) for line in (base / "probes.jsonl").read_text().splitlines()]
    assert not [p for p in (base / "kv").rglob("*") if p.is_file()]  # a complete pair leaves no checkpoint

    env = dict(os.environ, PACE_ALLOW_CODE_EVAL="1")
    _kill_at_first_save([sys.executable, "-m", "pace_bench", *_bench_args(model_dir, run)], run / "kv", env=env)
    assert (run / "probes.jsonl").read_text() == ""  # killed mid-pair: no record yet
    capsys.readouterr()
    assert runner.main([*_bench_args(model_dir, run), "--resume"]) == 0
    said = capsys.readouterr().out
    assert "resumed pace s0-0 from its checkpoint at token" in said and "(probe 1/3, probe)" in said
    at = int(said.split("checkpoint at token ")[1].split(" ")[0].replace(",", ""))
    assert 0 < at < expected[0]["context_len"]  # from the middle of the prefill, not from scratch
    got = [json.loads(line) for line in (run / "probes.jsonl").read_text().splitlines()]
    same = ("probe", "answer", "checks_passed", "recall_hits", "residency", "rotary_gap", "peak_cache_bytes",
            "full_cache_bytes", "failure")
    assert [{k: r.get(k) for k in same} for r in got] == [{k: r.get(k) for k in same} for r in expected]
    # the chunk log: every chunk once (the ones redone after the kill count once), the same cache bytes
    chunks, base_chunks = read_chunk_log(run / "chunks.jsonl"), read_chunk_log(base / "chunks.jsonl")
    assert [(c["seen"], c["cache_bytes"]) for c in chunks] == [(c["seen"], c["cache_bytes"]) for c in base_chunks]
    assert chunks[0]["seen"] == 64 and all(c["tokens_per_s"] > 0 for c in chunks)
    # the pair's entries are gone (a DiskTier temp file that the kill cut short may stay: not an entry)
    assert not [p for p in (run / "kv").rglob("*") if p.is_file() and not p.name.startswith(".tmp-")]


def test_a_checkpoint_of_other_settings_is_refused_and_kept(model_dir, tmp_path, monkeypatch, code_eval_allowed):
    """A pair cut short (its save left in the store) resumed with another budget: an error naming it,
    and the checkpoint still there for a resume with the right settings."""
    out = tmp_path / "run"
    calls = []

    def stop_after_two_saves(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # as a Ctrl-C in the middle of the prefill
        return real(*args, **kwargs)

    from pace_hf.memory import persist

    real = persist.save
    monkeypatch.setattr(persist, "save", stop_after_two_saves)
    with pytest.raises(KeyboardInterrupt):
        runner.main(_bench_args(model_dir, out))
    monkeypatch.setattr(persist, "save", real)
    saved = sorted(p for p in (out / "kv").rglob("*") if p.is_file())
    assert saved  # an interrupted pair keeps its checkpoint
    argv = _bench_args(model_dir, out)
    argv[argv.index("--budget") + 1] = "320"
    with pytest.raises(SystemExit, match="was made with other budget"):
        runner.main([*argv, "--resume"])
    assert sorted(p for p in (out / "kv").rglob("*") if p.is_file()) == saved


@pytest.mark.parametrize("argv,message", [
    (["--checkpoint-every", "4"], "give --store disk or valkey"),
    (["--checkpoint-every", "4", "--store", "host"], "give --store disk or valkey"),
    (["--checkpoint-every", "4", "--store", "disk", "--arms", "pace,full"], "the full arm (DynamicCache) has no save"),
    (["--checkpoint-every", "0", "--store", "disk"], "--checkpoint-every: must be >= 1"),
])
def test_checkpoint_arguments_of_the_command_line(argv, message, capsys, code_eval_allowed):
    with pytest.raises(SystemExit) as e:
        runner.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


# -- bench/run_1m.sh: the 1M-token session's command, at a small scale ---------------------------------------


def test_the_1m_script_runs_in_the_background_and_reports(model_dir, tmp_path):
    """The script's own command (nohup, --checkpoint-every, --resume, the report) on the tiny model at
    1.2K tokens: it returns at once, the run completes in the background and writes the report."""
    out, results = tmp_path / "run", tmp_path / "results"
    env = dict(os.environ, TOKENS="1200", MODEL=model_dir, BUDGET="256", CHUNK="64", LIMIT="1024", CHECKPOINT_EVERY="2",
               EXTRA="--max-new-tokens 4", OUT=str(out), RESULTS=str(results), PY=sys.executable,
               NICE="0")  # the real run yields the CPU; this one must finish while other jobs run
    started = subprocess.run(["bash", "bench/run_1m.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert started.returncode == 0 and "started in the background" in started.stdout, started.stderr
    deadline = time.monotonic() + 240
    while not (results / "report.md").exists() or "done:" not in (out / "run.log").read_text():
        assert time.monotonic() < deadline, (out / "run.log").read_text()[-3000:]
        time.sleep(0.5)
    report = (results / "report.md").read_text()
    assert "B=256, H=64, L=1,024" in report and "| fee_for |" in report and "Per-chunk tokens/s" in report
    assert "Per CPU-second of the run's process" in report and "the median chunk:" in report
    assert "| 0K-1K | " in report  # the table of stretches: one row here (1.2K tokens)
    chunks = [json.loads(line) for line in (out / "chunks.jsonl").read_text().splitlines()]
    assert all(0 < c["cpu_seconds"] for c in chunks)
    assert (results / "fig_chunks.png").stat().st_size > 0 and (results / "probes.jsonl").exists()
    settings = json.loads((results / "run.json").read_text())
    assert settings["checkpoint_every"] == 2 and settings["dtype"] == "float32" and settings["store"] == "disk"
    # a second start while one holds the lock is refused
    (out / "kv").mkdir(exist_ok=True)
    import fcntl

    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        again = subprocess.run(["bash", "bench/run_1m.sh", "--foreground"], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=30)
    assert again.returncode == 1 and "one run at a time" in again.stderr


def test_a_checkpoint_that_cannot_be_saved_warns_and_the_run_goes_on(tmp_path):
    """A save that reaches no durable tier (here the disk's root is under a regular file) raises
    ``SaveFailed`` in ``persist.save``; a checkpoint only warns: the previous one stands whole, the next
    one tries again, and hours of prefill are not thrown away (the 1M run died this way once)."""
    from pace_bench.checkpoint import PairCheckpoint
    from pace_hf.memory import persist

    (tmp_path / "file").write_bytes(b"x")
    store = TieredStore([DiskTier(tmp_path / "file" / "kv")])
    try:
        model = tiny_model("qwen2")
        cache = PACECache(model, budget=32, limit=96, recent=8, store=store, session_id="s")
        with torch.no_grad():
            model(torch.arange(3, 80)[None], cache=cache)
        with pytest.raises(persist.SaveFailed):
            persist.save(cache)
        checkpoint = PairCheckpoint(store, "s", every=1, expected={"budget": 32})
        save = checkpoint.saver(cache, lambda: {"ids": list(range(3, 80))})
        with pytest.warns(UserWarning, match="not saved, the previous one stands"):
            save()
        assert checkpoint.failed_saves == 1 and checkpoint.saves == 0
    finally:
        store.close()


def test_a_resume_the_store_cannot_answer_stops_and_deletes_nothing(tmp_path):
    """``--resume`` when no durable tier answers: an error that says so, not "no checkpoint" (which would
    start the pair over, and so delete a checkpoint that may be whole behind a tier that is briefly down)."""
    from pace_bench.checkpoint import PairCheckpoint

    kv = tmp_path / "kv"
    store = TieredStore([DiskTier(kv)])
    try:
        model = tiny_model("qwen2")
        cache = PACECache(model, budget=32, limit=96, recent=8, store=store, session_id="s")
        with torch.no_grad():
            model(torch.arange(3, 80)[None], cache=cache)
        checkpoint = PairCheckpoint(store, "s", every=1, expected={"budget": 32})
        checkpoint.saver(cache, lambda: {"ids": list(range(3, 80))})()
        cache.unbind()
        saved = sorted(p for p in kv.rglob("*") if p.is_file())
        kv.rename(tmp_path / "away")
        kv.write_text("the disk went away")
        with pytest.raises(SystemExit, match="--resume: session 's' cannot be resumed now"):
            checkpoint.resume(PACECache, model)
        kv.unlink()
        (tmp_path / "away").rename(kv)
        assert sorted(p for p in kv.rglob("*") if p.is_file()) == saved
        resumed, state = checkpoint.resume(PACECache, model)
        assert state["ids"] == list(range(3, 80)) and resumed.get_seq_length() == 77
        resumed.unbind()
    finally:
        store.close()
