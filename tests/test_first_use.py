"""What a new user meets first: the caches under ``torch.inference_mode()``, an unbound cache handed to
``generate``, the deprecation's words and ``ledger()``'s default layer (tiny random models, CPU)."""

import warnings

import pytest
import torch
from tiny_models import tiny_model

from pace_hf import Blueprint, H2OCache, HostTier, PACECache, SnapKVCache, Span, StreamingLLMCache, TieredStore

CACHES = {
    "pace": lambda model: PACECache(model, Blueprint([Span(0, 20, [1])]), budget=32, limit=112, recent=8),
    "pace_store": lambda model: PACECache(model, budget=32, limit=112, recent=8, store=TieredStore([HostTier()]),
                                          session_id="s"),
    "h2o": lambda model: H2OCache(model, budget=32, recent=8),
    "snapkv": lambda model: SnapKVCache(model, budget=32, recent=8),
    "streaming": lambda model: StreamingLLMCache(model, budget=32),
}


def prompt(n, seed=0):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("name", sorted(CACHES))
def test_every_cache_runs_under_inference_mode_as_under_no_grad(kind, name):
    """Servers and evaluation loops run under inference_mode, whose tensors have no version counter."""
    model = tiny_model(kind)
    runs = []
    for mode in (torch.no_grad, torch.inference_mode):
        cache = CACHES[name](model)
        with mode():
            out = model.generate(prompt(100), cache=cache, max_new_tokens=6, do_sample=False, prefill_chunk_size=16)
        runs.append((out, [cache.ledger(i) for i, _ in cache.evicting_layers]))
        assert cache.resident_count() <= 32 + 16  # it evicted
        cache.unbind()
    (out_grad, ledgers_grad), (out_inference, ledgers_inference) = runs
    assert torch.equal(out_grad, out_inference)
    for (logical_a, physical_a), (logical_b, physical_b) in zip(ledgers_grad, ledgers_inference):
        assert torch.equal(logical_a, logical_b) and torch.equal(physical_a, physical_b)


def test_the_design_cards_spelling_fails_before_the_first_forward_and_warns_of_the_call_made():
    """``model.generate(ids, past_key_values=PACECache(blueprint))``: the cache was never bound."""
    model = tiny_model("llama")
    forwards = []
    model.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.warns(DeprecationWarning) as caught:
        cache = PACECache(Blueprint([Span(0, 20, [1])]))
    said = " ".join(str(w.message) for w in caught if w.category is DeprecationWarning)
    assert "PACECache(blueprint) is deprecated" in said and "PACECache(blueprint, model)" not in said
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values= in generate
        with pytest.raises(RuntimeError, match=r"not bound to a model.*cache\.bind\(model\)"):
            model.generate(prompt(40), past_key_values=cache, max_new_tokens=2)
    assert not forwards  # refused before the prefill started
    stale = H2OCache(model, budget=32, recent=8)
    stale.unbind()
    before = len(forwards)  # binding may run the model (a probe of its layers); generate must not
    with pytest.raises(RuntimeError, match=r"not bound to a model \(it was unbound\)"):
        model.generate(prompt(40), cache=stale, max_new_tokens=2)
    assert len(forwards) == before
    with pytest.warns(DeprecationWarning, match=r"PACECache\(blueprint, model\) is deprecated"):
        PACECache(Blueprint(), model).unbind()


def test_ledger_reads_the_first_layer_that_evicts_by_default():
    """On Gemma 3 layer 0 is a sliding window: the README's ``cache.ledger()`` must show the planned span."""
    model = tiny_model("gemma3")  # layers: sliding (window 64), full
    cache = PACECache(model, Blueprint([Span(0, 20, [1])]), budget=32, limit=112, recent=8)
    cache.step = 1
    model.generate(prompt(150), cache=cache, max_new_tokens=2, do_sample=False, prefill_chunk_size=16)
    assert [i for i, _ in cache.evicting_layers] == [1]
    logical, physical = cache.ledger()
    assert torch.equal(logical, cache.ledger(1)[0]) and torch.equal(physical, cache.ledger(1)[1])
    assert torch.isin(torch.arange(20), logical).all()  # the planned span is resident
    assert not torch.isin(torch.arange(20), cache.ledger(0)[0]).any()  # the window has moved past it
