"""The decode benchmarks run end to end on a tiny model, so a change in the library that breaks one of
them (as a signature change once broke ``decode_speed``'s shadowed layer unseen) fails here, not hours
into a real run. Their timings are not checked; what they assert about the caches is."""

import json
import sys

import pytest
import torch


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend("bench")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_decode_speed_runs_and_its_in_place_layer_keeps_what_compaction_keeps(tiny_llama_dir, tmp_path, bench):
    import decode_speed

    decode_speed.main(["--model", str(tiny_llama_dir), "--tokens", "400", "--chunk", "128", "--steps", "2", "--rounds", "1",
                       "--budget", "160", "--limit", "1024", "--full", "600", "--full-steps", "1", "--full-rounds", "1",
                       "--check-steps", "24", "--dtype", "float32", "--threads", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "decode.json").read_text())
    assert set(report["at_resident_tokens"]) == {"dynamic", "h2o", "pace", "h2o_compacting"}
    assert report["full_caches"]["600"]["pace_tokens_per_s"] > 0
    for kind in ("h2o", "pace"):
        check = report["kept_sets_vs_compacting"][kind]
        assert check["evictions"] > 0 and check["mismatched_evictions"] == 0
        assert check["keys_values_scores_equal_at_end"]


def test_batch_decode_and_its_mixed_step_run(tiny_llama_dir, tmp_path, bench):
    import batch_decode

    batch_decode.main(["--model", str(tiny_llama_dir), "--tokens", "400", "--chunk", "128", "--budget", "160", "--limit", "1024",
                       "--sessions", "1,3", "--steps", "2", "--rounds", "1", "--chunks", "16", "--chunk-rows", "2",
                       "--chunk-steps", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["sessions"] for r in rows] == [1, 3] and all(r["pace batched tok/s"] > 0 for r in rows)
    assert (tmp_path / "table.md").exists() and (tmp_path / "chunks.md").exists()


def test_one_query_attention_runs(tmp_path, bench):
    import one_query_attention

    argv = ["one_query_attention.py", "--lengths", "64,300", "--dtypes", "float32,bfloat16", "--heads", "4",
            "--kv-heads", "2", "--dim", "16", "--rounds", "2", "--repeats", "1", "--out", str(tmp_path)]
    old, sys.argv = sys.argv, argv
    try:
        one_query_attention.main()
    finally:
        sys.argv = old
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == 4 and all(r["pace_attention ms"] > 0 for r in rows)
