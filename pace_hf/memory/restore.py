"""Bringing evicted tokens back: the background fetches of planned spans, the restores due at a step,
the merge into every layer, and the counters. A cache owns one ``Restores``; it reads the cache's
layers, spill and settings and leaves the cache's bracket to call it."""

from __future__ import annotations

import time

import torch

from .spill import concat


class Restores:
    """Pending fetches (``pending``: span -> (reader step, fetch)) and the restore counters (``stats``)."""

    def __init__(self):
        self.pending: dict[tuple[int, int], tuple[int, tuple]] = {}
        self.stats = {"restores": 0, "restored_tokens": 0, "last_restored": 0, "restore_seconds": 0.0,
                      "stall_seconds": 0.0, "last_stall_seconds": 0.0, "waited_fetches": 0}

    def forget_past(self, cut: int) -> None:
        """Drop the pending fetches of spans that reach past token ``cut`` (a rewound session)."""
        self.pending = {key: v for key, v in self.pending.items() if key[1] <= cut}

    def prefetch(self, cache) -> None:
        """Fetch, in the background, every planned span whose next reader is within
        ``cache.prefetch_steps`` steps and that is not fully resident."""
        blueprint = cache.blueprint
        if cache.spill is None or blueprint is None or not any(layer.is_initialized for _, layer in cache.evicting_layers):
            return
        seen = cache.get_seq_length()
        for span in blueprint.due(cache.step, cache.prefetch_steps):
            key = (span.start, min(span.end, seen))
            if key[0] >= key[1] or key in self.pending or cache.residency(range(*key)) == 1.0:
                continue
            self.pending[key] = (span.next_reader(cache.step), cache.spill.fetch(*key))

    def apply_due(self, cache) -> None:
        """Restore the pending spans whose reader step has come."""
        due = [(key, fetch) for key, (reader, fetch) in self.pending.items() if reader <= cache.step]
        if due:
            for key, _ in due:
                del self.pending[key]
            self.apply(cache, due)

    def apply(self, cache, fetches) -> None:
        """Insert fetched tokens into every layer, evict back to ``budget`` and renumber, before the
        next chunk runs. Restored planned tokens carry their bonus, so they stay."""
        started = time.perf_counter()
        waited = 0.0
        by_layer: dict[int, list] = {}
        pages: dict = {}  # (layer, page) -> the page read whole: settled once its layer has its tokens back
        for (start, end), fetch in fetches:
            t0 = time.perf_counter()
            late = not fetch[1].done()  # a fetch started too late (or a slow tier): the forward waits
            self.stats["waited_fetches"] += late
            fetch[1].result()  # the stall: how long the forward waits for the background fetch
            waited += time.perf_counter() - t0
            tokens, whole = cache.spill.collect(start, end, fetch)
            pages.update(whole)
            for layer_idx, part in tokens.items():
                by_layer.setdefault(layer_idx, []).append(part)
        restored, inserted = None, False
        for layer_idx, parts in sorted(by_layer.items()):
            layer, tokens = cache.layers[layer_idx], concat(parts)
            if not layer.is_initialized or tokens["logical"].numel() == 0:
                continue
            inserted = True
            before = [head.clone() for head in layer.logical]  # insert writes the ledger in place
            pushed = layer.insert(tokens, cache.scoring, cache.step, cache.quotas)
            cache.spill.settle(layer_idx, pages, layer.logical)  # what came back leaves the spill ...
            cache.evicted(layer_idx, pushed)  # ... and what it pushed out is spilled
            if restored is None:  # the first layer given tokens back gives the reading:
                # tokens (logical positions) back in any KV head, not (token, head) pairs
                back = [new[~torch.isin(new, old)] for new, old in zip(layer.logical, before)]
                restored = int(torch.unique(torch.cat(back)).numel())
        restored = restored or 0
        if cache.bounded and inserted:
            cache.renumber()
        stats = self.stats
        stats["restores"] += 1
        stats["restored_tokens"] += restored
        stats["last_restored"] = restored
        stats["restore_seconds"] += time.perf_counter() - started
        stats["stall_seconds"] += waited
        stats["last_stall_seconds"] = waited


__all__ = ["Restores"]
