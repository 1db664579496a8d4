"""The spill log: every token a cache evicts goes to a ``TieredStore``, so a plan can bring it back.

Granularity. Evicted tokens are buffered per layer and written as one entry per layer once the buffer
holds ``entry_tokens`` tokens per KV head (256 by default, LMCache's chunk size), and at ``flush()``
(``cache.save()``, or before a restore reads the store). Not per eviction: a decode step evicts one
token per layer and head, and an entry per step would mean 24 tiny writes per token on a 24-layer
model. Not as a write-through log of whole chunks either: a chunk's tokens are spilled only if they
are evicted, with the score and reference position they had then, and most of a long session is
never needed again after it is scored.

What an entry holds, per token (flat, so KV heads may evict different tokens): its KV head, logical
position, reference key and reference position (the key as rotated at that position: a restore
re-rotates it exactly, never from an already re-rotated copy), value and score.

Buffered tokens are readable at once; written entries are found through an index of each entry's
logical range and digest, which ``state()`` hands to ``cache.save()`` (``pace_hf.persist``).

Keys are never reused: ``L3/spill/<writer>-17``, where ``writer`` is new for every log (every cache, every
resume). A session resumed twice, or by two processes, never overwrites an entry that a save indexes. Each
written entry's confirmation (``TieredStore.put``) is kept in ``unconfirmed`` until a save has checked that
it reached every durable tier: the manifest indexes only entries that are durable.
"""

from __future__ import annotations

import secrets
from concurrent.futures import Future

import torch

from .tiers.entry import digest

FIELDS = ("head", "logical", "ref_pos", "score", "ref_key", "value")


def empty_tokens(like: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    if like is not None:
        return {k: v[:0] for k, v in like.items()}
    return {k: torch.empty(0, dtype=torch.long) for k in FIELDS}


def concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    parts = [p for p in parts if p["logical"].numel()]
    return {k: torch.cat([p[k] for p in parts]) for k in FIELDS} if parts else empty_tokens()


def select(tokens: dict[str, torch.Tensor], start: int, end: int) -> dict[str, torch.Tensor]:
    inside = (tokens["logical"] >= start) & (tokens["logical"] < end)
    return {k: v[inside] for k, v in tokens.items()}


class SpillLog:
    """Per-layer buffers of evicted tokens, their entries in the store, and the index to find them."""

    def __init__(self, store, session_id: str, fingerprint: str, n_layers: int, entry_tokens: int = 256):
        self.store, self.session_id, self.fingerprint = store, session_id, fingerprint
        self.entry_tokens = entry_tokens
        self.buffers: list[list[dict]] = [[] for _ in range(n_layers)]
        self.buffered = [0] * n_layers  # tokens in each layer's buffer
        self.index: list[list[list]] = [[] for _ in range(n_layers)]  # [key, lowest, highest logical, digest]
        self.writer = secrets.token_hex(4)
        self.next_entry = 0
        self.spilled_tokens = 0
        self.unconfirmed: dict[str, Future] = {}  # key -> its write's confirmation, until a save checks it
        self.generation: str | None = None  # the save this log continues (set by save and resume)
        self.tier_errors: dict[str, int] = {}  # each durable tier's error count when a save last confirmed it

    def add(self, layer_idx: int, tokens: dict[str, torch.Tensor]) -> None:
        """Buffer evicted tokens (copied to the CPU); write the layer's entry once it is full."""
        if tokens["logical"].numel() == 0:
            return
        self.buffers[layer_idx].append({k: v.detach().to("cpu", copy=True) for k, v in tokens.items()})
        self.spilled_tokens += tokens["logical"].numel()
        self.buffered[layer_idx] += tokens["logical"].numel()
        heads = int(tokens["head"].max()) + 1
        if self.buffered[layer_idx] >= self.entry_tokens * heads:
            self.flush_layer(layer_idx)

    def flush_layer(self, layer_idx: int) -> None:
        if not self.buffers[layer_idx]:
            return
        tokens = concat(self.buffers[layer_idx])
        key = f"L{layer_idx}/spill/{self.writer}-{self.next_entry}"
        self.next_entry += 1
        low, high = int(tokens["logical"].min()), int(tokens["logical"].max())
        meta = {"layer": layer_idx, "low": low, "high": high}
        self.unconfirmed[key] = self.store.put(key, tokens, meta, fingerprint=self.fingerprint,
                                               session_id=self.session_id)
        self.index[layer_idx].append([key, low, high, digest(tokens, meta)])
        self.buffers[layer_idx] = []
        self.buffered[layer_idx] = 0

    def flush(self) -> None:
        for layer_idx in range(len(self.buffers)):
            self.flush_layer(layer_idx)

    def keys_for(self, start: int, end: int) -> list[tuple[int, str]]:
        """(layer, key) of every written entry that may hold logical positions in ``[start, end)``."""
        return [(layer_idx, key) for layer_idx, entries in enumerate(self.index)
                for key, low, high, _digest in entries if low < end and high >= start]

    def fetch(self, start: int, end: int) -> tuple[list, Future]:
        """Start fetching the written entries that may hold ``[start, end)`` in the background. Pass
        the result to :meth:`collect`, which adds what was spilled since."""
        wanted = self.keys_for(start, end)
        return wanted, self.store.prefetch([key for _, key in wanted], fingerprint=self.fingerprint,
                                           session_id=self.session_id)

    def collect(self, start: int, end: int, fetch: tuple[list, Future]) -> dict[int, dict[str, torch.Tensor]]:
        """The evicted tokens of ``[start, end)`` per layer, oldest copy first: the prefetched entries,
        entries written since the prefetch, then the buffers. An entry that is missing or fails
        verification is left out (the store counts it), so a restore brings back what it can."""
        wanted, future = fetch
        got = dict(zip([key for _, key in wanted], future.result()))
        late = [(layer_idx, key) for layer_idx, key in self.keys_for(start, end) if key not in got]
        if late:
            got.update(zip([key for _, key in late], self.store.get_many(
                [key for _, key in late], fingerprint=self.fingerprint, session_id=self.session_id)))
        parts: list[list[dict]] = [[] for _ in self.buffers]
        for layer_idx, key in wanted + late:
            if got.get(key) is not None:
                parts[layer_idx].append(select(got[key][0], start, end))
        for layer_idx, buffers in enumerate(self.buffers):
            parts[layer_idx] += [select(b, start, end) for b in buffers]
        return {layer_idx: concat(p) for layer_idx, p in enumerate(parts)}

    def entries(self) -> dict[str, tuple[int, str]]:
        """Every written entry: key -> (layer, digest)."""
        return {key: (layer_idx, dig) for layer_idx, entries in enumerate(self.index) for key, _lo, _hi, dig in entries}

    def state(self) -> dict:
        """The index and counters a save records (the writer is not: a resumed log writes under a new one)."""
        return {"index": self.index, "spilled_tokens": self.spilled_tokens, "entry_tokens": self.entry_tokens}

    def load(self, state: dict, generation: str) -> None:
        self.index = [list(map(list, layer)) for layer in state["index"]]
        self.spilled_tokens, self.entry_tokens = state["spilled_tokens"], state["entry_tokens"]
        self.generation = generation
