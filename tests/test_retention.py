"""Retention (pace_hf.memory.retention): a store stays under a byte cap and an age, whole sessions at a
time, least recently saved first, never a kept session or one under a live writer's lease."""

from pathlib import Path

import pytest
from conftest import prefill, random_ids
from tiny_models import tiny_model

from pace_hf import PACECache
from pace_hf.memory import retention
from pace_hf.tiers import DiskTier, TieredStore


@pytest.fixture
def store_with_sessions(tmp_path):
    model = tiny_model("llama")
    store = TieredStore([DiskTier(tmp_path / "kv")])
    for i in range(4):
        cache = PACECache(model, budget=48, limit=160, recent=8, store=store, session_id=f"s{i}")
        prefill(model, cache, random_ids(120, seed=i), 40)
        cache.save()
        cache.unbind()
    store.flush()
    yield store
    store.close()


def test_a_byte_cap_deletes_whole_sessions_oldest_save_first_and_keeps_what_it_is_told(store_with_sessions):
    store = store_with_sessions
    sizes = retention.session_sizes(store)
    assert sorted(sizes) == ["s0", "s1", "s2", "s3"] and all(n > 0 for n in sizes.values())
    when = [retention.saved_at(store, f"s{i}") for i in range(4)]
    assert when == sorted(when) and when[0] > 0
    cap = sizes["s2"] + sizes["s3"]
    assert retention.retain(store, max_bytes=cap, keep={"s0"}) == ["s1", "s2"]  # s0 kept: s1, then s2 go
    assert sorted(store.usage()) == ["s0", "s3"]
    with store.lease("s3"):  # a live writer's session stays, whatever the cap
        assert retention.retain(store, max_bytes=0) == ["s0"]
    assert sorted(store.usage()) == ["s3"]
    # what is left resumes whole: nothing was deleted from inside a session
    PACECache.resume("s3", store=store, model=tiny_model("llama")).unbind()


def test_an_age_deletes_the_sessions_saved_before_it(store_with_sessions):
    store = store_with_sessions
    when = {f"s{i}": retention.saved_at(store, f"s{i}") for i in range(4)}
    cut = (when["s1"] + when["s2"]) / 2
    assert retention.retain(store, max_age_s=10.0, now=cut + 10.0) == ["s0", "s1"]
    assert sorted(store.usage()) == ["s2", "s3"]
    assert retention.retain(store) == []  # no cap and no age: nothing
    with pytest.raises(ValueError, match=">= 0"):
        retention.retain(store, max_bytes=-1)


def test_a_session_whose_manifest_is_damaged_is_never_retired(store_with_sessions):
    """Issue 50: a damaged manifest read as "no save", dated 0, so retention deleted that session first.
    Its age cannot be read and a repair would restore it: it stays, file for file, whatever the cap."""
    store = store_with_sessions
    path = store.tiers[0].path_for("pace:s0:manifest")
    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"\xff" * 8)
    files = {p: p.read_bytes() for p in Path(store.tiers[0].root).rglob("*.kv") if "%3As0%3A" in p.name}
    assert retention.saved_at(store, "s0") is None and retention.saved_at(store, "nobody") == 0.0
    assert retention.retain(store, max_bytes=0) == ["s1", "s2", "s3"]
    assert retention.retain(store, max_age_s=0.0) == []
    assert {p: p.read_bytes() for p in files} == files
