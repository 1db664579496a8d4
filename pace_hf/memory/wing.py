"""``KVMemory``: what one session keeps beside its resident cache: spill, restores and saves.

The cache evicts and says so; the memory listens. A cache calls its memory at four points (bound to a
model, a step set, a forward about to run, tokens evicted) and otherwise knows nothing of stores,
spills or manifests: ``pace_hf.cache`` imports nothing from this package. ``PACESession`` and pace-serve
reach a session's memory through ``cache.memory``; a cache built with ``store=`` builds its own
(``EvictionCache.memory_class``, set below, is the one place that says so).
"""

from __future__ import annotations

from ..blueprint import Span, as_index
from ..cache.eviction import EvictionCache
from . import persist
from .restore import Restores
from .spill import SpillLog


MEMORY_KNOBS = ("prefetch_steps", "spill_tokens", "spill_cap_bytes")  # besides the store and the session id


class KVMemory:
    """One session's memory: the store and its knobs, the spill log (with a store) and the restores.

    Args: as ``EvictionCache``'s ``store``, ``session_id``, ``prefetch_steps``, ``spill_tokens`` and
    ``spill_cap_bytes``. Without a store it spills nothing and restores nothing (its counters stay 0)."""

    def __init__(self, store=None, session_id: str | None = None, prefetch_steps: int = 1, spill_tokens: int = 64,
                 spill_cap_bytes: int | None = None):
        if store is not None:
            persist.check_store(store, session_id)
        prefetch_steps, spill_tokens = as_index(prefetch_steps, "prefetch_steps"), as_index(spill_tokens, "spill_tokens")
        if prefetch_steps < 0 or spill_tokens < 1:
            raise ValueError(f"prefetch_steps must be >= 0 and spill_tokens >= 1 (got prefetch_steps={prefetch_steps}, "
                             f"spill_tokens={spill_tokens})")
        if spill_cap_bytes is not None and as_index(spill_cap_bytes, "spill_cap_bytes") < 0:
            raise ValueError(f"spill_cap_bytes must be >= 0 or None, got {spill_cap_bytes}")
        self.store, self.session_id = store, session_id
        self.prefetch_steps, self.spill_tokens, self.spill_cap_bytes = prefetch_steps, spill_tokens, spill_cap_bytes
        self.spill: SpillLog | None = None
        self.fingerprint: str | None = None
        self.restores = Restores()

    # -- what the cache tells its memory ---------------------------------------------------------------
    def bound(self, cache, model) -> None:
        """The cache was bound to ``model``: a spill log for its layers (new, or empty and of another model)."""
        if self.store is None:
            return
        from ..tiers import model_fingerprint

        fingerprint = model_fingerprint(model)
        if self.spill is None or fingerprint != self.fingerprint:
            self.fingerprint = fingerprint
            self.new_spill(len(cache.layers))

    def new_spill(self, layers: int) -> None:
        """An empty spill log that continues this memory's save, if it has one: the next save replaces it
        (a new log alone would be a new writer, refused as a second one)."""
        old = self.spill
        self.spill = SpillLog(self.store, self.session_id, self.fingerprint, layers, self.spill_tokens,
                              self.spill_cap_bytes)
        if old is not None:
            self.spill.generation, self.spill.saved_keys = old.generation, old.saved_keys

    def step_set(self, cache) -> None:
        """A new step: fetch in the background the planned spans it will soon read."""
        self.restores.prefetch(cache)

    def before_forward(self, cache) -> None:
        """A forward is about to run: merge the restores whose reader step has come."""
        self.restores.apply_due(cache)

    def evicted(self, layer_idx: int, tokens) -> None:
        """Tokens a layer evicted (flat, see ``EvictingLayer.tokens_at``): spilled with a store."""
        if self.spill is not None:
            self.spill.add(layer_idx, tokens)

    def reset(self, cache) -> None:
        """The cache forgot every token: pending fetches go, and the spill index starts afresh."""
        self.restores.pending.clear()
        if self.spill is not None:
            self.new_spill(len(cache.layers))

    # -- what a session asks of it ---------------------------------------------------------------------
    def stats(self) -> dict:
        out = dict(self.restores.stats)
        if self.spill is not None:
            out["spilled_tokens"] = self.spill.spilled_tokens
            out["spill"] = dict(self.spill.stats, held_bytes=self.spill.held_bytes)
        if self.store is not None:
            out["store"] = self.store.stats
        return out

    def restore(self, cache, start: int, end: int) -> int:
        """See ``EvictionCache.restore``."""
        start, end = as_index(start, "start"), as_index(end, "end")
        if not 0 <= start < end:
            raise ValueError(f"restore needs 0 <= start < end, got [{start}, {end})")
        if self.spill is None:
            raise ValueError("restore needs a cache with a store (store=..., session_id=...) bound to a model")
        if cache.blueprint is None:
            raise ValueError("restored tokens stay resident through their foresight bonus: restore needs a "
                             "cache with a Foresight policy (PACECache)")
        if cache.in_forward:
            raise RuntimeError("restore cannot run inside a forward")
        cache.blueprint.add(Span(start, end, [cache.step]))
        self.restores.apply(cache, [((start, end), self.spill.fetch(start, end))])
        return self.restores.stats["last_restored"]

    def retrieve(self, cache, text: str, ids, tokenizer=None, *, retriever=None):
        """See ``EvictionCache.retrieve``: the first call builds a ``PageRetriever`` (or keeps
        ``retriever``), later calls reuse it."""
        from .retrieval import PageRetriever

        if retriever is not None:
            self.retriever = retriever
        elif getattr(self, "retriever", None) is None:
            self.retriever = PageRetriever(tokenizer)
        return self.retriever.retrieve(cache, text, ids)

    def save(self, cache) -> str:
        """See ``EvictionCache.save``."""
        return persist.save(cache)

    @staticmethod
    def resume(cls, session_id: str, *, store, model, scoring=None):
        """See ``EvictionCache.resume``: the verified save, built as ``cls``."""
        return persist.resume(cls, session_id, store=store, model=model, scoring=scoring)[0]


EvictionCache.memory_class = KVMemory  # a cache built with store= builds its own memory

__all__ = ["KVMemory"]
