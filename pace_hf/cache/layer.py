"""One layer's storage: resident tokens, their ledger and scores, and the counters the layer owns.

``EvictingLayer`` is what an ``EvictionCache`` is a list of; ``CompactingLayer`` is its plain reference,
which the tests and the decode speed script hold it to. ``keep_index`` picks what eviction keeps.
"""

from __future__ import annotations

import ctypes

import torch
from transformers.cache_utils import DynamicLayer

from ..rope import RotaryParams, rerotate


def keep_index(priority: torch.Tensor, budget: int, sinks: int, recent: int) -> torch.Tensor:
    """Indices ``[kv_heads, budget]`` (sorted) of the highest-priority tokens; the first ``sinks`` and
    the last ``recent`` stored tokens are always kept.

    When fewer tokens go than stay (decode drops one per head), it picks the ones to drop and counts
    past them: sorting the ``budget`` kept indices cost more than the rest of a step's eviction."""
    heads, n = priority.shape
    position = torch.arange(n, device=priority.device)
    protected = (position < sinks) | (position >= n - recent)
    score = priority.masked_fill(protected[None, :], float("inf"))
    drop = n - budget
    if drop > budget:
        return score.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values
    dropped = score.topk(drop, dim=-1, largest=False, sorted=False).indices
    rank = position[:budget].expand(heads, budget)
    if drop == 1:  # decode: the kept tokens from the dropped one's rank on are one further
        return rank + rank.ge(dropped)
    # the kept token of rank r is r plus the dropped tokens before it; the j-th dropped token has
    # dropped[j] - j kept tokens before it
    before = torch.searchsorted(dropped.sort(dim=-1).values - position[:drop], rank.contiguous(), right=True)
    return before.add_(rank)


def _shift_up(row: torch.Tensor, start: int, end: int, shift: int) -> None:
    """``row[start:end] = row[start + shift:end + shift]`` on a device (source and target overlap, and torch
    refuses an overlapping ``copy_``). On the CPU a run is one ``memmove`` instead (``_move_runs``): a copy
    through a clone reads and writes every byte twice and allocates."""
    row[start:end].copy_(row[start + shift:end + shift].clone())


def cache_nbytes(cache) -> int:
    """Bytes held by the tensors of a cache's layers: keys and values and, for the eviction caches,
    reference keys, ledger and scores. A buffer counts whole, room to spare included (it is held),
    and storage shared by two tensors counts once. Works for any transformers cache with ``layers``;
    it is what a memory comparison against DynamicCache reads."""
    seen, total = set(), 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if torch.is_tensor(value) and value.numel():
                storage = value.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


_ROWS = ("keys", "values", "ref_keys")  # [1, kv_heads, capacity, head_dim]
_LEDGER = ("logical", "physical", "ref_pos", "scores")  # [kv_heads, capacity]
_SLICED_RUNS = 8  # up to this many runs of moved tokens (over heads), move them by slices


class EvictingLayer(DynamicLayer):
    """One layer's resident tokens, ledger and scores. Batch size 1.

    Counters (the layer owns them, as ``DynamicSlidingWindowLayer`` owns ``cumulative_length``):
    ``cumulative_length`` tokens were given to the layer (logical positions ``0..cumulative_length-1``;
    what ``get_seq_length`` returns), ``resident_count`` of them are held, and the scores of the first
    ``scored`` are up to date.

    Storage: each per-token tensor is a buffer with room to spare (it grows geometrically, up to
    ``budget`` plus the chunk), and ``keys``, ``values``, ``logical``, ``physical``, ``scores`` and
    (bounded positions) ``ref_keys``, ``ref_pos`` are views of its first ``resident_count`` slots, in
    logical order per KV head, so the ledger's columns follow the stored keys. Why this design:
    - Append writes the chunk in place; ``torch.cat`` copied the whole layer for every decoded token.
    - Eviction compacts in place and moves, per KV head, only the tokens after its first evicted one:
      the least that keeping logical order allows. On Qwen at 8K resident tokens a decode step moves
      about a third of the layer (the decode speed script reports the fraction; H2O's victims are
      spread over the context), not two whole copies as ``torch.cat`` and a gather did. A decode
      step's moved tokens form one run per head, moved as one slice copy (a memcpy, about twice as
      fast as the indexed gather and scatter a prefill chunk's scattered evictions still use).
    - Why not refill evicted slots from the tail, with the ledger ordered through a permutation? It
      moves less, but attention then sums the keys in another order: outputs and scores change in
      their last bits, and the kept sets drift from the schedule of a cache in logical order. Logical
      order keeps every step bit-identical to plain compaction (``tests/test_cache.py`` holds the two
      equal over hundreds of decode steps), and torch's flash kernel and matmul give the same bits on
      these strided views as on contiguous copies.
    """

    evicts = True

    def __init__(self, keep_reference: bool, budget: int):
        super().__init__()
        self._before = None
        self.keep_reference = keep_reference
        self.budget = budget
        self.cumulative_length = self.resident_count = self.scored = 0
        self.capacity = self.moved = 0  # moved: tokens the last eviction moved, over heads (a reading)
        self._buffers: dict[str, torch.Tensor] = {}
        self._views: dict[int, dict[str, torch.Tensor]] = {}  # resident count -> views of the buffers
        self.logical = self.physical = self.scores = None
        self.ref_keys = self.ref_pos = None

    def lazy_initialization(self, key_states, value_states):
        self.dtype, self.device = key_states.dtype, key_states.device
        _, heads, _, key_dim = key_states.shape
        value_dim = value_states.shape[-1]
        rows = {"keys": (key_dim, key_states.dtype), "values": (value_dim, value_states.dtype)}
        ledger = {"logical": torch.long, "physical": torch.long, "scores": torch.float32}
        if self.keep_reference:
            rows["ref_keys"], ledger["ref_pos"] = (key_dim, key_states.dtype), torch.long
        self._buffers = {name: torch.empty(1, heads, 0, dim, dtype=dtype, device=self.device)
                         for name, (dim, dtype) in rows.items()}
        self._buffers.update({name: torch.empty(heads, 0, dtype=dtype, device=self.device)
                              for name, dtype in ledger.items()})
        self.capacity = 0
        self.is_initialized = True
        self._views = {}
        self._view()

    def _view(self) -> None:
        """Point the public tensors at the first ``resident_count`` slots of the buffers. The views of the
        last few counts are kept: in steady decode the count alternates between ``budget`` and one more,
        and making seven views twice a step was a measurable share of a batched step's bookkeeping."""
        n = self.resident_count
        views = self._views.get(n)
        if views is None:
            if len(self._views) >= 4:
                self._views.clear()
            views = self._views[n] = {name: buffer[:, :, :n] if name in _ROWS else buffer[:, :n]
                                      for name, buffer in self._buffers.items()}
        for name, view in views.items():
            setattr(self, name, view)

    def _reserve(self, needed: int) -> None:
        """Room for ``needed`` tokens: grow geometrically, but not past what the steady state needs
        (``budget`` plus this chunk), so a layer at its budget holds no more than it uses."""
        if needed <= self.capacity:
            return
        chunk = needed - self.resident_count
        capacity = max(needed, min(2 * self.capacity, self.budget + chunk))
        n = self.resident_count
        for name, old in self._buffers.items():
            dim = -2 if name in _ROWS else -1
            shape = list(old.shape)
            shape[dim] = capacity
            new = torch.empty(shape, dtype=old.dtype, device=old.device)
            new.narrow(dim, 0, n).copy_(old.narrow(dim, 0, n))
            self._buffers[name] = new
        self.capacity = capacity
        self._views = {}

    # -- the transformers layer contract -------------------------------------------------------
    def _accept(self, key_states, value_states) -> None:
        """Initialize on the first chunk, and refuse KV of another dtype, device or shape than the layer
        holds (the model was moved or cast after the cache was filled): it would be mixed with the old
        KV, or fail deep inside a copy. An empty (reset) layer takes the new kind."""
        if self.is_initialized:
            held = (self.keys.dtype, self.keys.device, self.keys.shape[1], self.keys.shape[-1], self.values.shape[-1])
            new = (key_states.dtype, key_states.device, key_states.shape[1], key_states.shape[-1],
                   value_states.shape[-1])
            if new == held:
                return
            if self.cumulative_length:
                raise ValueError(f"this cache holds KV as {held[0]} on {held[1]} ({held[2]} KV heads of {held[3]}), "
                                 f"but the model now gives {new[0]} on {new[1]} ({new[2]} KV heads of {new[3]}): was "
                                 "it cast or moved after the cache was filled? Use the model as it was, or reset() "
                                 "the cache (or create a new one) to start over")
        self.lazy_initialization(key_states, value_states)

    def update(self, key_states, value_states, *args, logical_start=None, physical_start=None, **kwargs):
        if logical_start is None:
            raise RuntimeError("EvictingLayer.update needs chunk positions; call it through its cache")
        self._accept(key_states, value_states)
        q, n = key_states.shape[-2], self.resident_count
        self._reserve(n + q)
        new = torch.arange(q, device=self.device)
        b = self._buffers
        b["keys"][:, :, n:n + q].copy_(key_states)
        b["values"][:, :, n:n + q].copy_(value_states)
        b["logical"][:, n:n + q] = new + logical_start
        b["physical"][:, n:n + q] = new + physical_start
        b["scores"][:, n:n + q] = 0.0
        if self.keep_reference:  # keys arrive rotated at their physical position: that is the reference
            b["ref_keys"][:, :, n:n + q].copy_(key_states)
            b["ref_pos"][:, n:n + q] = new + physical_start
        self.resident_count += q
        self.cumulative_length += q
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.resident_count + query_length, self.cumulative_length - self.resident_count

    def reset(self) -> None:
        """Forget every token (the buffers are kept for reuse)."""
        self.cumulative_length = self.resident_count = self.scored = 0
        if self.is_initialized:
            self._view()

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("pace_hf caches do not support beam search yet (num_beams must be 1)")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("pace_hf caches hold one sequence; batch expansion is not supported")

    def batch_select_indices(self, indices):
        raise NotImplementedError("pace_hf caches hold one sequence; batch selection is not supported")

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("pace_hf caches cannot be cropped (assisted decoding is not supported)")

    # -- scores, eviction, restore and renumbering ---------------------------------------------------
    def record_scores(self, fresh: torch.Tensor, policy) -> None:
        """Fold this forward's column sums ``[kv_heads, resident_count]`` into the scores, in place."""
        out = policy.accumulate(self.scores, fresh)
        if out.data_ptr() != self.scores.data_ptr():
            self.scores.copy_(out)
        self.scored = self.resident_count

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every per-token tensor of the layer, compact (for save and for bit-exact checks)."""
        return {name: getattr(self, name).contiguous() for name in self._buffers}

    def load(self, tensors: dict[str, torch.Tensor], seen: int) -> None:
        """Hold ``tensors`` (as :meth:`tensors` gives them) after ``seen`` tokens. Scores saved by a
        policy that keeps none (an empty tensor) load as zeros."""
        keys, values = tensors["keys"], tensors["values"]
        self.resident_count = 0
        self.lazy_initialization(keys, values)
        n = keys.shape[-2]
        self._reserve(n)
        self.resident_count = n
        self._view()
        for name in self._buffers:
            saved = tensors.get(name)
            if name == "scores" and saved.shape[-1] != n:
                self.scores.zero_()
                continue
            getattr(self, name).copy_(saved)
        self.scored = tensors["scores"].shape[-1]
        self.cumulative_length = seen

    def tokens_at(self, head: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored tokens at (head, slot) pairs, flat, as a spill entry holds them: what an exact
        restore needs (value, reference key and position, logical position, score)."""
        ref_keys = self.ref_keys if self.keep_reference else self.keys
        ref_pos = self.ref_pos if self.keep_reference else self.physical
        return {"head": head, "logical": self.logical[head, pos], "ref_pos": ref_pos[head, pos],
                "score": self.scores[head, pos], "ref_key": ref_keys[0, head, pos], "value": self.values[0, head, pos]}

    def evict(self, policy, step: int, quotas, collect: bool = True) -> dict[str, torch.Tensor] | None:
        """Keep the ``quotas.budget`` tokens of highest ``policy.priority`` at ``step`` per KV head (the
        sinks and the recent tokens always), in prefill and decode alike; returns the evicted tokens flat
        (when ``collect``). The one eviction path: a restore's :meth:`insert` ranks by the same rule."""
        priority = policy.priority(self.logical, self.scores, step)
        return self.keep(keep_index(priority, min(quotas.budget, self.resident_count), quotas.sinks, quotas.recent),
                         collect=collect)

    def keep(self, index: torch.Tensor, collect: bool = True) -> dict[str, torch.Tensor] | None:
        """Keep the tokens at ``index`` ([kv_heads, m], sorted per head) and return the dropped ones
        flat (when ``collect``: only a cache that spills needs them). In place: per head, the kept
        tokens after the first dropped one move up; nothing before it is touched."""
        heads, n = self.logical.shape
        m = index.shape[-1]
        evicted = None
        if collect:
            dropped = torch.ones((heads, n), dtype=torch.bool, device=index.device)
            dropped.scatter_(1, index, False)
            evicted = self.tokens_at(*dropped.nonzero(as_tuple=True))
        if n - m == 1:  # decode: one run a head, from the token it dropped (what its sum lacks; empty if the last)
            gone = (n * (n - 1) // 2 - index.sum(-1)).tolist()
            self.moved = self._move_runs(list(range(heads)), gone, [1] * heads, m)
        else:  # a run: kept tokens that move up by the same shift (the tokens dropped before them)
            shift = index - torch.arange(m, device=index.device)
            head, start = torch.diff(shift, dim=-1, prepend=shift.new_zeros(heads, 1)).nonzero(as_tuple=True)
            if start.numel() <= _SLICED_RUNS:
                self.moved = self._move_runs(head.tolist(), start.tolist(), shift[head, start].tolist(), m)
            else:
                self.moved = self._move_rows(index, heads, m)
        self.resident_count = m
        self.scored = min(self.scored, m)
        self._view()
        return evicted

    def _move_runs(self, heads: list[int], starts: list[int], shifts: list[int], m: int) -> int:
        """Few runs (decode drops one token per head: one run): each moves as one slice, a memcpy,
        front to back (a run's target ends where the next run's source begins, so none is clobbered).
        Returns how many tokens moved."""
        ends = [starts[i + 1] if i + 1 < len(starts) and heads[i + 1] == h else m for i, h in enumerate(heads)]
        runs = list(zip(heads, starts, ends, shifts))
        for name, buffer in self._buffers.items():
            if buffer.device.type == "cpu" and buffer.is_contiguous():  # one memmove a run, from raw pointers
                size = buffer.element_size()
                head, token = (buffer.stride(-3) * size, buffer.stride(-2) * size) if name in _ROWS else (buffer.stride(0) * size, size)
                base = buffer.data_ptr()
                for h, start, end, s in runs:
                    at = base + h * head
                    ctypes.memmove(at + start * token, at + (start + s) * token, (end - start) * token)
                continue
            rows = buffer[0] if name in _ROWS else buffer
            for h, start, end, s in runs:
                _shift_up(rows[h], start, end, s)
        return sum(end - start for start, end in zip(starts, ends))

    def _move_rows(self, index: torch.Tensor, heads: int, m: int) -> int:
        """Many runs (a prefill chunk's eviction): every moved token by one gather and one scatter.
        Returns how many tokens moved."""
        # sorted and distinct: once a head's index passes its rank, every later token moves
        head, rank = (index != torch.arange(m, device=index.device)).nonzero(as_tuple=True)
        if rank.numel():
            base = head * self.capacity
            src, dst = base + index.view(-1).index_select(0, head * m + rank), base + rank
            for name, buffer in self._buffers.items():
                flat = buffer.view(heads * self.capacity, -1) if name in _ROWS else buffer.view(-1)
                flat.index_copy_(0, dst, flat.index_select(0, src))
        return rank.numel()

    def drop_last(self, count: int) -> None:
        """Forget the ``count`` newest tokens (the partial writes of a failed forward)."""
        self.resident_count -= count
        self.cumulative_length -= count
        self.scored = min(self.scored, self.resident_count)
        self._view()

    def insert(self, tokens: dict[str, torch.Tensor], policy, step: int, quotas) -> dict[str, torch.Tensor]:
        """Insert restored ``tokens`` (flat, as ``tokens_at`` gives them) in logical order, then keep the
        ``quotas.budget`` tokens of highest ``policy.priority`` at ``step`` per head (as :meth:`evict`
        ranks). Returns the resident tokens pushed out, flat.

        A restored token comes back with its reference key and position, and its stored key is that
        reference: unbounded layers keep keys at their logical position, and the caller renumbers
        bounded layers, which re-rotates every key from its reference."""
        dev = self.logical.device
        ref_keys = self.ref_keys if self.keep_reference else self.keys
        ref_pos = self.ref_pos if self.keep_reference else self.physical
        candidates = []
        for h in range(self.logical.shape[0]):
            resident = self.logical[h]
            sel = (tokens["head"] == h).nonzero().flatten()
            logical, inverse = torch.unique(tokens["logical"][sel], return_inverse=True)
            newest = torch.full((logical.numel(),), -1, dtype=torch.long)  # the newest spilled copy wins
            sel = sel[newest.scatter_reduce(0, inverse, torch.arange(sel.numel()), "amax")]
            sel = sel[~torch.isin(logical, resident.cpu())]
            cand = {"logical": resident, "ref_pos": ref_pos[h], "ref_key": ref_keys[0, h], "value": self.values[0, h],
                    "score": self.scores[h]}
            cand = {k: torch.cat([v, tokens[k][sel].to(dev, v.dtype)]) for k, v in cand.items()}
            was_resident = torch.arange(cand["logical"].numel(), device=dev) < resident.numel()
            order = cand["logical"].argsort()
            candidates.append(({k: v[order] for k, v in cand.items()}, was_resident[order]))
        keep = min(quotas.budget, min(c["logical"].numel() for c, _ in candidates))  # every head keeps as many
        rows, pushed = [], []
        for h, (cand, was_resident) in enumerate(candidates):
            priority = policy.priority(cand["logical"][None], cand["score"][None], step)
            index = keep_index(priority, keep, quotas.sinks, quotas.recent)[0]
            out = was_resident.clone()
            out[index] = False
            pushed.append({"head": torch.full((int(out.sum()),), h, dtype=torch.long), **{k: v[out] for k, v in cand.items()}})
            rows.append({k: v[index] for k, v in cand.items()})
        stack = lambda name: torch.stack([r[name] for r in rows])  # noqa: E731
        self._reserve(keep)
        self.resident_count = keep
        self._view()
        self.logical.copy_(stack("logical"))
        self.values.copy_(stack("value")[None])
        self.keys.copy_(stack("ref_key")[None])
        self.physical.copy_(stack("ref_pos"))
        self.scores.copy_(stack("score"))
        self.scored = keep
        if self.keep_reference:
            self.ref_keys.copy_(self.keys)
            self.ref_pos.copy_(self.physical)
        return {k: torch.cat([p[k] for p in pushed]) for k in pushed[0]}

    def offsets(self, room: int) -> torch.Tensor:
        """Each resident's distance back to the newest one, per KV head, laid out in at most ``room``
        positions: the logical gaps between neighbours, each capped at the largest cap (per head) that
        fits. Neighbours stay neighbours, and the gaps eviction left keep as much of their width as the
        room allows, instead of all collapsing to 1 (which cost H2O's kept set 26% of call NLL on long
        agent sessions). ``room`` below the resident count gives the compact layout."""
        if self.logical.shape[-1] < 2:
            return torch.zeros_like(self.logical)
        gaps = self.logical.diff(dim=-1)
        low, high = torch.ones_like(gaps[:, 0]), gaps.amax(-1)
        while bool((low < high).any()):  # the largest cap whose layout fits, by bisection per head
            mid = (low + high + 1) // 2
            fits = gaps.minimum(mid[:, None]).sum(-1) < room
            low, high = torch.where(fits, mid, low), torch.where(fits, high, mid - 1)
        back = gaps.minimum(low[:, None]).flip(-1).cumsum(-1).flip(-1)
        return torch.cat([back, torch.zeros_like(back[:, :1])], -1)

    def renumber(self, params: RotaryParams | None, physical: torch.Tensor) -> None:
        """Move the residents to ``physical`` (the cache's ``top - 1 - offsets(room)``, one row per KV head),
        re-rotating their keys from the reference. A NoPE layer (``params`` None) moves only its
        positions: its keys carry none."""
        self.physical.copy_(physical)
        if params is not None and self.keep_reference:
            self.keys.copy_(rerotate(self.ref_keys, self.ref_pos[None], self.physical[None], params,
                                     out_dtype=self.keys.dtype))

    # -- the forward bracket: a failed forward's partial writes are the newest tokens
    def begin_forward(self) -> None:
        self._before = self.cumulative_length

    def end_forward(self) -> None:
        self._before = None

    def abort_forward(self) -> None:
        if self._before is not None and self.is_initialized and self.cumulative_length > self._before:
            self.drop_last(self.cumulative_length - self._before)
        self._before = None

    def can_drop_last(self, count: int) -> bool:
        """Whether the last ``count`` tokens are all still resident in every KV head (a rewind forgets them)."""
        if not self.is_initialized or count == 0:
            return True
        return bool(((self.logical >= self.cumulative_length - count).sum(-1) == count).all())


class CompactingLayer(EvictingLayer):
    """The plain twin of ``EvictingLayer``, as eviction was first written: a chunk is appended with
    ``torch.cat`` and an eviction gathers the kept tokens into new tensors, so a decoded token copies
    the layer twice. ``EvictingLayer`` must keep exactly what this keeps, bit for bit; the tests and
    the decode speed script hold it to that (``cache.layer_class = CompactingLayer`` before binding)."""

    def update(self, key_states, value_states, *args, logical_start=None, physical_start=None, **kwargs):
        if logical_start is None:
            raise RuntimeError("EvictingLayer.update needs chunk positions; call it through its cache")
        self._accept(key_states, value_states)
        q, heads = key_states.shape[-2], key_states.shape[1]
        new = torch.arange(q, device=self.device).expand(heads, q)
        parts = {"keys": key_states, "values": value_states, "logical": new + logical_start,
                 "physical": new + physical_start, "scores": torch.zeros(heads, q, device=self.device)}
        if self.keep_reference:
            parts.update(ref_keys=key_states, ref_pos=new + physical_start)
        for name, part in parts.items():
            setattr(self, name, torch.cat([getattr(self, name), part], dim=-2 if name in _ROWS else -1))
        self.resident_count += q
        self.cumulative_length += q
        return self.keys, self.values

    def keep(self, index: torch.Tensor, collect: bool = True) -> dict[str, torch.Tensor] | None:
        heads, n = self.logical.shape
        evicted = None
        if collect:
            dropped = torch.ones((heads, n), dtype=torch.bool, device=index.device)
            dropped.scatter_(1, index, False)
            evicted = self.tokens_at(*dropped.nonzero(as_tuple=True))
        rows = (index + torch.arange(heads, device=index.device)[:, None] * n).reshape(-1)
        for name in self._buffers:
            t = getattr(self, name)
            kept = t.reshape(heads * n, -1).index_select(0, rows).view(1, heads, -1, t.shape[-1]) if name in _ROWS \
                else t.gather(1, index)
            setattr(self, name, kept)
        self.resident_count = index.shape[-1]
        self.scored = min(self.scored, self.resident_count)
        return evicted

    def drop_last(self, count: int) -> None:
        self.resident_count -= count
        self.cumulative_length -= count
        self.scored = min(self.scored, self.resident_count)
        for name in self._buffers:
            t = getattr(self, name)
            setattr(self, name, t[:, :, :self.resident_count] if name in _ROWS else t[:, :self.resident_count])


__all__ = ["CompactingLayer", "EvictingLayer", "cache_nbytes", "keep_index"]
