"""What a run reads from a cache at each probe: residency of the needed tokens and the rotary gap (the
ledger, read at the probe's first query), the tier counters, and the peak bytes the cache held beside
what the full cache would hold. Shared by the coding suite (:mod:`pace_bench.runner`) and RULER
(:mod:`pace_bench.ruler`).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import StoppingCriteria

from pace_hf import EvictionCache
from pace_hf.binding import decoder_of
from pace_hf.cache import cache_nbytes

TIER_FIELDS = ("restores", "restored_tokens", "stall_seconds", "spilled_tokens")


def ledger_at_probe(cache, needed: torch.Tensor) -> dict:
    """Residency of the needed tokens (mean over layers and KV heads) and the rotary gap between the
    probe's first query and the farthest resident needed token (None when none is resident)."""
    if not isinstance(cache, EvictionCache):  # the full arm: everything resident at its logical position
        seen = cache.get_seq_length()
        return {"residency": 1.0, "rotary_gap": int(seen - needed.min()) if needed.numel() else None}
    return {"residency": cache.residency(needed), "rotary_gap": cache.rotary_gap(needed)}


class ReadAtFirstQuery(StoppingCriteria):
    """Reads the ledger once, when generate has prefilled the probe and is about to feed its first
    answer token (the first stopping check); never stops generation."""

    def __init__(self, cache, needed: torch.Tensor):
        self.cache, self.needed, self.reading = cache, needed, None

    def __call__(self, input_ids, scores, **kwargs):
        if self.reading is None:
            self.reading = ledger_at_probe(self.cache, self.needed)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def tier_reading(cache) -> dict:
    """The cache's tier counters (cumulative over the session so far), or {} without a store."""
    if not isinstance(cache, EvictionCache) or cache.store is None:
        return {}
    stats = cache.tier_stats
    return {"tier": {k: (round(stats[k], 4) if isinstance(stats.get(k), float) else stats.get(k, 0))
                     for k in TIER_FIELDS}}


@contextlib.contextmanager
def peak_cache_bytes(model, cache):
    """Yields ``{"bytes": n}``, the most the cache held (:func:`pace_hf.cache.cache_nbytes`) at the end
    of any forward's last decoder layer. Why there: every layer holds the chunk it just appended and
    the eviction caches evict only after the forward, so that is each forward's peak. A model whose
    decoder has no ``layers`` list yields ``{"bytes": None}``: not measured."""
    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        yield {"bytes": None}
        return
    peak = {"bytes": 0}

    def on_last_layer(*_):
        peak["bytes"] = max(peak["bytes"], cache_nbytes(cache))

    handle = layers[-1].register_forward_hook(on_last_layer)
    try:
        yield peak
    finally:
        handle.remove()


def full_cache_bytes(model, tokens: int) -> int:
    """What DynamicCache would hold for ``tokens`` tokens: keys and values of every layer and KV head,
    in the model's dtype."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * tokens * model.dtype.itemsize
