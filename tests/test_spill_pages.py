"""The spill log addressed by logical page (issue 25 item 0): a restore reads the pages its span covers,
every evicted token has exactly one copy, the spill can be capped, and saves index page versions."""

import warnings

import pytest
import torch
from conftest import prefill, random_ids
from tiny_models import tiny_model

from pace_hf import PACECache
from pace_hf.scoring import Recency
from pace_hf.memory.persist import MANIFEST_FINGERPRINT, MANIFEST_KEY
from pace_hf.tiers import DiskTier, TieredStore

PAGE = 16
SID = "pages"
CHUNK = 32  # prefill tokens a forward


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def decode(model, cache, steps, seed=0):
    """One token a forward: H2O evicts the newest unprotected token and, now and then, an old one."""
    prefill(model, cache, random_ids(steps, seed), 1)


def new_cache(model, store, **kw):
    kw = dict(budget=48, limit=160, recent=8, store=store, session_id=SID, spill_tokens=PAGE, **kw)
    return PACECache(model, **kw)


def token_bytes(model):
    """Payload bytes of one spilled token: head, logical and reference position (int32), score (fp32),
    reference key and value."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return 3 * 4 + 4 + 2 * head_dim * model.dtype.itemsize


def disk_read(store):
    return store.stats["disk"]["bytes_read"]


def spilled_copies(cache):
    """Per (layer, head, logical): how many copies the spill holds (versions in the store and buffers)."""
    copies = {}
    spill = cache.spill
    for layer_idx, layer in enumerate(spill.pages):
        keys = [v[0] for versions in layer.values() for v in versions]
        parts = [got[0] for got in cache.store.get_many(keys, fingerprint=cache.fingerprint, session_id=SID)]
        parts += [part for buffer in spill.buffers[layer_idx].values() for part in buffer]
        for part in parts:
            for h, p in zip(part["head"].tolist(), part["logical"].tolist()):
                copies[(layer_idx, h, p)] = copies.get((layer_idx, h, p), 0) + 1
    return copies


def assert_every_token_once(cache):
    """Every position seen is resident or spilled, and never both, never twice (nothing lost, nothing
    read twice)."""
    copies = spilled_copies(cache)
    assert max(copies.values()) == 1
    seen = cache.get_seq_length()
    for layer_idx, layer in enumerate(cache.layers):
        for h, resident in enumerate(layer.logical.tolist()):
            spilled = {p for (lay, head, p) in copies if lay == layer_idx and head == h}
            assert not spilled & set(resident)
            assert spilled | set(resident) == set(range(seen)), (layer_idx, h)


def test_a_restore_reads_the_pages_it_covers_not_the_session(model, tmp_path):
    store = TieredStore([DiskTier(tmp_path)])
    cache = new_cache(model, store)
    prefill(model, cache, random_ids(600), CHUNK)
    decode(model, cache, 120)  # scattered evictions: old heavy hitters go too
    store.flush()
    per_token = token_bytes(model)
    layers, heads = len(cache.layers), cache.layers[0].logical.shape[0]
    edges = 2 * layers * heads * PAGE * per_token  # one page per layer and head at each edge
    total, spans = 0, [(100, 132), (333, 361), (7, 9), (560, 592)]
    for step, (start, end) in enumerate(spans):
        cache.step = step  # the span restored before loses its bonus
        missing = sum(int((~torch.isin(torch.arange(start, end), row)).sum())
                      for layer in cache.layers for row in layer.logical.cpu())
        before = disk_read(store)
        cache.restore(start, end)
        read = disk_read(store) - before
        assert read <= 2 * missing * per_token + edges, (start, end, read, missing * per_token)
        assert cache.residency(range(start, end)) == 1.0
        total += read
        store.flush()
    assert total > 0
    # the log grows; a restore of the same width costs the same
    decode(model, cache, 150, seed=1)
    store.flush()
    before = disk_read(store)
    cache.step = len(spans)
    cache.restore(200, 232)
    late = disk_read(store) - before
    assert late <= 2 * 32 * layers * heads * per_token + edges
    assert late < 0.1 * cache.tier_stats["spill"]["held_bytes"]
    assert_every_token_once(cache)
    store.close()


def test_restored_then_evicted_again_has_one_copy_the_newest(model, tmp_path):
    store = TieredStore([DiskTier(tmp_path)])
    cache = new_cache(model, store, scorer=Recency())  # once its bonus lapses, a restored span goes again
    prefill(model, cache, random_ids(400), CHUNK)
    for round_ in range(3):  # restore, let the bonus lapse, evict again, restore again
        cache.step = 2 * round_
        cache.restore(40, 72)
        assert cache.residency(range(40, 72)) == 1.0
        cache.step = 2 * round_ + 1
        prefill(model, cache, random_ids(96, seed=round_ + 1), CHUNK)
        assert cache.residency(range(40, 72)) < 0.5
        assert_every_token_once(cache)
    written = cache.tier_stats["spill"]["bytes_written"]
    # each evicted token once, plus what restores rewrote of the pages they read but did not take
    assert written < 2 * cache.spill.spilled_tokens * token_bytes(model)
    store.close()


def test_bytes_written_per_evicted_token_is_the_token(model, tmp_path):
    store = TieredStore([DiskTier(tmp_path)])
    cache = new_cache(model, store)
    prefill(model, cache, random_ids(500), CHUNK)
    decode(model, cache, 100)
    cache.spill.flush()
    stats = cache.tier_stats["spill"]
    assert stats["bytes_written"] == cache.spill.spilled_tokens * token_bytes(model)  # nothing rewritten
    assert stats["held_bytes"] == stats["bytes_written"]
    store.close()


def test_the_spill_cap_drops_least_recently_used_pages_and_says_so(model, tmp_path):
    store = TieredStore([DiskTier(tmp_path)])
    per_page = len(model.model.layers) * 2 * PAGE * token_bytes(model)
    cap = 6 * per_page
    cache = new_cache(model, store, spill_cap_bytes=cap)
    prefill(model, cache, random_ids(800), CHUNK)
    decode(model, cache, 50)
    cache.spill.flush()
    store.flush()
    stats = cache.tier_stats["spill"]
    assert stats["held_bytes"] <= cap and stats["capped_pages"] > 0
    # what the store holds is what the index names: dropped versions were deleted
    files = [p for p in tmp_path.rglob("*") if p.is_file() and "spill" in p.name]
    assert len(files) == len(cache.spill.entries())
    with pytest.warns(UserWarning, match="spill cap"):
        assert cache.restore(64, 96) == 0  # its pages were dropped: nothing comes back, and no error
    assert cache.tier_stats["spill"]["capped_requests"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, counted every time
        assert cache.restore(64, 96) == 0
    assert cache.tier_stats["spill"]["capped_requests"] == 4
    late = min(cache.spill.pages[0]) * PAGE  # the pages used last are still there
    assert cache.restore(late, late + 16) > 0
    with pytest.raises(ValueError, match="spill_cap_bytes"):
        new_cache(model, store, spill_cap_bytes=-1)
    store.close()


def test_saves_index_page_versions_and_a_retired_version_outlives_the_save_that_names_it(model, tmp_path):
    store = TieredStore([DiskTier(tmp_path)])
    cache = new_cache(model, store)
    prefill(model, cache, random_ids(400), CHUNK)
    g1 = cache.save()
    manifest = store.get(MANIFEST_KEY, fingerprint=MANIFEST_FINGERPRINT, session_id=SID)[1]
    saved = set(cache.spill.entries())
    assert {v[0] for layer in manifest["spill"]["index"] for v in layer} == saved
    cache.restore(40, 72)  # retires the versions of those pages that g1 indexes
    retired = saved - set(cache.spill.entries())
    assert retired
    store.flush()
    resumed = PACECache.resume(SID, store=TieredStore([DiskTier(tmp_path)]), model=model)  # g1 is still whole
    assert resumed.spill.generation == g1 and set(resumed.spill.entries()) == saved
    resumed.restore(40, 72)
    assert resumed.residency(range(40, 72)) == 1.0
    resumed.unbind()
    cache.save()  # replaces g1: what only g1 named goes (reads miss it at once, the writer deletes it)
    assert all(store.get(key, fingerprint=cache.fingerprint, session_id=SID) is None for key in retired)
    store.flush()
    on_disk = TieredStore([DiskTier(tmp_path)])
    assert all(on_disk.get(key, fingerprint=cache.fingerprint, session_id=SID) is None for key in retired)
    again = PACECache.resume(SID, store=TieredStore([DiskTier(tmp_path)]), model=model)
    assert set(again.spill.entries()) == set(cache.spill.entries())
    assert again.residency(range(40, 72)) == 1.0
    again.unbind()
    store.close()


def test_a_save_of_format_2_is_refused_naming_it_and_a_new_cache_replaces_it(model, tmp_path):
    store = TieredStore([DiskTier(tmp_path)])
    cache = new_cache(model, store)
    prefill(model, cache, random_ids(200), CHUNK)
    store.put("L0/spill/old-0", {"logical": torch.arange(3)}, {"layer": 0}, fingerprint=cache.fingerprint,
              session_id=SID)
    store.put(MANIFEST_KEY, {}, {"format": 2, "generation": "g1-abcdef", "model_fingerprint": cache.fingerprint,
                                 "entries": {}, "layers": [True, True],
                                 "spill": {"index": [[["L0/spill/old-0", 0, 2, "xxh3_128:0"]], []]}},
              fingerprint=MANIFEST_FINGERPRINT, session_id=SID)
    store.flush()
    with pytest.raises(ValueError, match="saved in save format 2; .* by time of eviction"):
        PACECache.resume(SID, store=store, model=model)
    cache.save()  # a new cache may save over it; the old spill entry goes
    assert store.get("L0/spill/old-0", fingerprint=cache.fingerprint, session_id=SID) is None
    PACECache.resume(SID, store=store, model=model).unbind()
    store.close()
