"""Tests for pace_hf.sandbox (filled out below)."""

from pace_hf.sandbox import run_calls


def test_values_come_back(monkeypatch):
    monkeypatch.setenv("PACE_ALLOW_CODE_EVAL", "1")
    r = run_calls("def f(x):\n    return [x, (x,)]\n", ["f(2)"])
    assert r[0].status == "ok" and r[0].value == [2, [2]]
