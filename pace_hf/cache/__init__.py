"""PACE and its baselines as drop-in transformers caches.

``model.generate(ids, cache=PACECache(model, blueprint))`` is all a user writes
(``past_key_values=`` works too: transformers 5.24 deprecates it in ``generate`` until 6.0, and
versions before 5.24 only accept that name).

How it fits into transformers (see the README's "How it works"):
- A cache is a list of ``EvictingLayer``: tensors ``[batch, kv_heads, n, head_dim]`` plus an
  explicit ledger of logical and physical positions per KV head, per-token scores and, for bounded
  positions, reference keys with their reference positions.
- What to keep is a ``ScoringPolicy`` (``pace_hf.scoring``); ``limit`` (or None) switches bounded
  positions on. The ablation arms are compositions: ``H2OCache(limit=...)`` is positions-only,
  ``PACECache(limit=None)`` retention-only.
- Binding the cache to a model (``pace_hf.binding``) installs the hooks that bracket each forward:
  ``begin_forward`` renumbers when the next chunk would pass ``limit`` and hands physical positions to
  the rotary embedding; ``end_forward`` evicts down to ``budget`` at the chunk boundary, so every layer
  announces the same kv length to the mask. ``unbind()`` undoes it.
- Each layer keeps its counters, as ``DynamicSlidingWindowLayer`` keeps ``cumulative_length``:
  ``get_seq_length()`` is the number of tokens seen, so ``generate`` slices new input correctly;
  ``get_mask_sizes`` announces ``resident_count + q`` keys. Decode appends and evicts in place
  (see ``EvictingLayer``).
- A batch (``generate`` on ``[b, n]`` ids with an ``attention_mask``) is a list of one-sequence caches,
  ``cache.rows``, run as the rows of each forward (``batch``, ``CacheRows``): every row keeps its own
  budget, positions and memory, and pad tokens are never stored.
- With a ``store`` (``pace_hf.tiers``), nothing evicted is lost: the cache tells its memory
  (``cache.memory``, ``pace_hf.memory.wing.KVMemory``) what it evicts, and the memory spills, restores
  and saves. This package imports nothing from ``pace_hf.memory``.

The package follows transformers' layer/cache seam: ``layer`` (``EvictingLayer`` and its plain
reference ``CompactingLayer``), ``batch`` (``CacheRows``), ``eviction`` (``EvictionCache``), ``quotas`` (what the budget is split into), ``layout`` and ``probe`` (what each
layer is and what it does with positions), ``window`` (sliding and linear layers) and ``presets`` (the
named caches).
"""

from .batch import CacheRows
from .eviction import EvictionCache
from .layer import CompactingLayer, EvictingLayer, cache_nbytes, keep_index
from .quotas import DEFAULT_RECENT, DEFAULT_SINKS, Quotas
from .presets import H2OCache, PACECache, SnapKVCache, StreamingLLMCache

__all__ = ["CacheRows", "CompactingLayer", "DEFAULT_RECENT", "DEFAULT_SINKS", "EvictingLayer", "EvictionCache", "H2OCache",
           "PACECache", "Quotas", "SnapKVCache", "StreamingLLMCache", "cache_nbytes", "keep_index"]
