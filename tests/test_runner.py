"""The benchmark runner: arms, ledger readings, the table, and a brief real-model run."""

import json

import pytest
import torch
from tiny_models import tiny_model

from pace_hf import Blueprint, EvictionCache, ObservationWindow, Span
from pace_hf.bench.runner import (ARMS, ArmSettings, completed_records, ledger_at_probe, main, make_cache,
                                  progress_line, summarize)


def test_every_arm_builds_the_cache_it_names():
    model = tiny_model("qwen2")
    bp = Blueprint([Span(0, 8, [1])])
    caches = {arm: make_cache(arm, model, bp, ArmSettings(budget=256, limit=512)) for arm in ARMS}
    assert type(caches["full"]).__name__ == "DynamicCache"
    flags = {arm: (c.blueprint is not None, c.bounded) for arm, c in caches.items() if isinstance(c, EvictionCache)}
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


def test_progress_line_names_the_failed_facts():
    record = {"arm": "pace", "session_id": "s0-0", "probe": "settle", "checks_passed": 1, "checks_total": 2,
              "recall_hits": 3, "recall_total": 6, "seconds": 12.0, "residency": 1.0, "rotary_gap": 4000,
              "checks": [{"name": "c1", "fact": "exception_code", "passed": False}, {"name": "c2", "fact": None,
                                                                                       "passed": True}]}
    line = progress_line(record)
    assert "checks 1/2" in line and "failed: exception_code" in line and "gap 4,000" in line


@pytest.mark.slow
def test_runner_plays_a_short_session_on_the_smoke_model(tmp_path, monkeypatch):
    monkeypatch.setenv("PACE_ALLOW_CODE_EVAL", "1")
    rc = main(["--model", "smollm2-135m", "--arms", "h2o,pace", "--sessions", "1", "--tokens", "1200",
               "--budget", "768", "--limit", "1536", "--chunk", "512", "--max-new-tokens", "16",
               "--out", str(tmp_path)])
    assert rc == 0
    records = [json.loads(line) for line in (tmp_path / "probes.jsonl").read_text().splitlines()]
    assert sorted(r["arm"] for r in records) == ["h2o"] * 3 + ["pace"] * 3
    pace = [r for r in records if r["arm"] == "pace"]
    assert all(r["residency"] == 1.0 for r in pace)  # the oracle blueprint keeps the definitions
    assert all(r["rotary_gap"] < 1536 for r in pace)
    assert all(r["context_len"] > 768 for r in pace)  # so eviction really happened
    assert (tmp_path / "table.md").read_text().count("\n| ") >= 3
    assert (tmp_path / "accuracy_vs_gap.png").stat().st_size > 0
