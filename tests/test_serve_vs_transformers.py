"""``bench/serve_vs_transformers.py`` end to end on a tiny model: both real servers (pace-serve and
``transformers serve --continuous-batching``) as subprocesses, the real ``openai`` client, so that the
comparison a run of hours depends on fails here first. Its timings are not checked; its counts are."""

import json

import pytest


@pytest.fixture
def svt(monkeypatch):
    monkeypatch.syspath_prepend("bench")
    import serve_vs_transformers

    return serve_vs_transformers


def rows(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


ARGS = ["--sessions", "2", "--length", "200", "--turns", "1", "--new-tokens", "40", "--max-tokens", "4",
        "--budget", "160"]


def test_both_servers_play_every_turn_and_a_rerun_plays_nothing_again(svt, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    svt.main(["--model-dir", str(tiny_llama_dir), *ARGS, "--out", str(out)])
    played = rows(out)
    assert sorted(r["server"] for r in played) == ["pace", "transformers"]
    for r in played:
        assert r["errors"] == [] and r["timed_turns"] == 2
        assert [t["turn"] for t in r["per_turn"]].count(0) == 2  # each session's untimed warm-up
        assert all(t["ttft"] is not None and t["completion"] > 0 for t in r["per_turn"])
        # each timed turn extends a history the server has seen: both take some of it from cache
        assert 0 < r["reused_tokens"] < r["prompt_tokens"]
        log = (out / f"{r['server']}-s2-l200-r0.log").read_text()
        # scrubbed of this machine's paths: the model directory and the arm's scratch directory (its store)
        assert str(tiny_llama_dir) not in log and f"svt.{r['server']}." not in log
    assert (out / "table.md").read_text().count("| 2 | 200 |") == 2

    capsys.readouterr()
    svt.main(["--model-dir", str(tiny_llama_dir), *ARGS, "--out", str(out)])
    assert len(rows(out)) == 2 and capsys.readouterr().err.count("already in") == 2


def test_requests_past_the_timeout_are_counted_as_errors_and_the_table_still_renders(svt, tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    svt.main(["--model-dir", str(tiny_llama_dir), *ARGS, "--timeout", "0.001", "--out", str(out)])
    for r in rows(out):
        assert len(r["errors"]) == 2 and all("turn 0" in e and "Timeout" in e for e in r["errors"])
        assert r["timed_turns"] == 0 and r["ttft_p99"] is None
    table = (out / "table.md").read_text()
    assert table.count("(2 errors) | 0 | 0 | 0.00 | 0.00 | - | - |") == 2
