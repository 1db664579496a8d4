"""PACE and its baselines as drop-in transformers caches.

``model.generate(ids, cache=PACECache(blueprint, model=model))`` is all a user writes
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
- With a ``store`` (``pace_hf.tiers``), nothing evicted is lost: see ``pace_hf.spill``.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import attention
from .binding import Binding
from .blueprint import Blueprint, Span, as_index
from .rope import RotaryParams, rerotate
from .rope.params import is_nested
from . import persist
from .scoring import (CumulativeAttention, Foresight, ForesightBonus, ObservationWindow, Recency, ScoringPolicy,
                      rebuild)
from .spill import SpillLog, concat

DEFAULT_SINKS = 4
DEFAULT_RECENT = 128


def keep_index(priority: torch.Tensor, budget: int, sinks: int, recent: int) -> torch.Tensor:
    """Indices ``[kv_heads, budget]`` (sorted) of the highest-priority tokens; the first ``sinks`` and
    the last ``recent`` stored tokens are always kept."""
    n = priority.shape[-1]
    position = torch.arange(n, device=priority.device)
    protected = (position < sinks) | (position >= n - recent)
    score = priority.masked_fill(protected[None, :], float("inf"))
    return score.topk(budget, dim=-1, sorted=False).indices.sort(dim=-1).values


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
      the least that keeping logical order allows. H2O mostly evicts the newest unprotected token
      (fresh tokens have had the fewest queries to score them), so a decode step moves about
      ``recent`` tokens, not the layer (the decode speed script reports the fraction moved).
    - Why not refill evicted slots from the tail, with the ledger ordered through a permutation? It
      moves less, but attention then sums the keys in another order: outputs and scores change in
      their last bits, and the kept sets drift from the schedule of a cache in logical order. Logical
      order keeps every step bit-identical to plain compaction (``tests/test_cache.py`` holds the two
      equal over hundreds of decode steps), and torch's flash kernel and matmul give the same bits on
      these strided views as on contiguous copies.
    """

    def __init__(self, keep_reference: bool, budget: int):
        super().__init__()
        self.keep_reference = keep_reference
        self.budget = budget
        self.cumulative_length = self.resident_count = self.scored = 0
        self.capacity = self.moved = 0  # moved: tokens the last eviction moved, over heads (a reading)
        self._buffers: dict[str, torch.Tensor] = {}
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
        self._view()

    def _view(self) -> None:
        """Point the public tensors at the first ``resident_count`` slots of the buffers."""
        n = self.resident_count
        for name, buffer in self._buffers.items():
            setattr(self, name, buffer[:, :, :n] if name in _ROWS else buffer[:, :n])

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

    # -- the transformers layer contract -------------------------------------------------------
    def update(self, key_states, value_states, *args, logical_start=None, physical_start=None, **kwargs):
        if logical_start is None:
            raise RuntimeError("EvictingLayer.update needs chunk positions; call it through its cache")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
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
        # sorted and distinct: once a head's index passes its rank, every later token moves
        head, rank = (index != torch.arange(m, device=index.device)).nonzero(as_tuple=True)
        if rank.numel():
            base = head * self.capacity
            src, dst = base + index.view(-1).index_select(0, head * m + rank), base + rank
            for name, buffer in self._buffers.items():
                flat = buffer.view(heads * self.capacity, -1) if name in _ROWS else buffer.view(-1)
                flat.index_copy_(0, dst, flat.index_select(0, src))
        self.moved = rank.numel()
        self.resident_count = m
        self.scored = min(self.scored, m)
        self._view()
        return evicted

    def drop_last(self, count: int) -> None:
        """Forget the ``count`` newest tokens (the partial writes of a failed forward)."""
        self.resident_count -= count
        self.cumulative_length -= count
        self.scored = min(self.scored, self.resident_count)
        self._view()

    def insert(self, tokens: dict[str, torch.Tensor], policy, step: int, budget: int, sinks: int,
               recent: int) -> dict[str, torch.Tensor]:
        """Insert restored ``tokens`` (flat, as ``tokens_at`` gives them) in logical order, then keep the
        ``budget`` tokens of highest ``policy.priority`` at ``step`` per head. Returns the resident
        tokens pushed out, flat.

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
        keep = min(budget, min(c["logical"].numel() for c, _ in candidates))  # every head keeps as many
        rows, pushed = [], []
        for h, (cand, was_resident) in enumerate(candidates):
            priority = policy.priority(cand["logical"][None], cand["score"][None], step)
            index = keep_index(priority, keep, sinks, recent)[0]
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

    def renumber(self, params: RotaryParams) -> None:
        """Physical positions become 0..n-1 in logical order; keys are re-rotated from the reference."""
        self.physical.copy_(torch.arange(self.resident_count, device=self.device).expand_as(self.physical))
        self.keys.copy_(rerotate(self.ref_keys, self.ref_pos[None], self.physical[None], params,
                                 out_dtype=self.keys.dtype))


class CompactingLayer(EvictingLayer):
    """The plain twin of ``EvictingLayer``, as eviction was first written: a chunk is appended with
    ``torch.cat`` and an eviction gathers the kept tokens into new tensors, so a decoded token copies
    the layer twice. ``EvictingLayer`` must keep exactly what this keeps, bit for bit; the tests and
    the decode speed script hold it to that (``cache.layer_class = CompactingLayer`` before binding)."""

    def update(self, key_states, value_states, *args, logical_start=None, physical_start=None, **kwargs):
        if logical_start is None:
            raise RuntimeError("EvictingLayer.update needs chunk positions; call it through its cache")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
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


class EvictionCache(DynamicCache):
    """The shared base: a token budget, a scoring policy and, with ``limit``, bounded positions.

    Every arm of the 2x2 ablation is this class with another policy or limit, so they share the
    prefill schedule, the eviction schedule and the decode path.

    Args:
        model: the model to bind to (installs hooks and the ``pace_sdpa`` attention function).
        budget: resident tokens kept per layer and KV head after each forward.
        sinks / recent: the first ``sinks`` and the last ``recent`` tokens are never evicted.
        scoring: a ``pace_hf.scoring.ScoringPolicy`` (default ``CumulativeAttention()``, H2O).
        limit: keep every rotary position below ``limit`` by renumbering residents (None: unbounded).
            It must exceed ``budget`` plus the largest chunk a forward brings.
        store / session_id: a ``pace_hf.tiers.TieredStore``: every evicted token is spilled to it, and
            planned spans that are not resident are restored when their reader step comes (fetched
            ``prefetch_steps`` steps ahead, in the background). ``save()`` / ``resume()`` persist the
            session there. ``spill_tokens``: logical positions per spill page (a restore reads the pages
            its span covers); ``spill_cap_bytes``: the most spilled bytes the session holds (least
            recently used pages go first; see ``pace_hf.spill``).

    ``torch.compile(model.forward)`` is not supported: the hooks, the cache and ``pace_sdpa`` break
    the graph at every layer, and the cache's counters change every forward, so a compiled forward
    gains nothing and may recompile on each one. Run the model uncompiled.
    """

    layer_class = EvictingLayer  # what ``bind`` builds the layers from

    def __init__(
        self,
        model=None,
        *,
        budget: int = 2048,
        sinks: int = DEFAULT_SINKS,
        recent: int = DEFAULT_RECENT,
        scoring: ScoringPolicy | None = None,
        limit: int | None = None,
        store=None,
        session_id: str | None = None,
        prefetch_steps: int = 1,
        spill_tokens: int = 64,
        spill_cap_bytes: int | None = None,
    ):
        budget, sinks, recent = (as_index(v, n) for v, n in ((budget, "budget"), (sinks, "sinks"), (recent, "recent")))
        if budget <= 0 or sinks < 0 or recent < 0:
            raise ValueError(f"budget must be > 0 and sinks, recent >= 0 (got {budget}, {sinks}, {recent})")
        if budget < sinks + recent:
            raise ValueError(f"budget {budget} cannot hold the protected sinks + recent = {sinks} + {recent} tokens")
        scoring = scoring if scoring is not None else CumulativeAttention()
        if not isinstance(scoring, ScoringPolicy):
            raise TypeError(f"scoring must be a pace_hf.scoring.ScoringPolicy, got {type(scoring).__name__}")
        if limit is not None:
            limit = as_index(limit, "limit")
            if limit <= budget:
                raise ValueError(f"limit {limit} must exceed budget {budget} plus the chunk size")
        if store is not None and not (isinstance(session_id, str) and session_id):
            raise ValueError("a cache with a store needs a session_id (a non-empty str) to name its entries")
        prefetch_steps, spill_tokens = as_index(prefetch_steps, "prefetch_steps"), as_index(spill_tokens, "spill_tokens")
        if prefetch_steps < 0 or spill_tokens < 1:
            raise ValueError(f"prefetch_steps must be >= 0 and spill_tokens >= 1 (got {prefetch_steps}, {spill_tokens})")
        if spill_cap_bytes is not None and as_index(spill_cap_bytes, "spill_cap_bytes") < 0:
            raise ValueError(f"spill_cap_bytes must be >= 0 or None, got {spill_cap_bytes}")
        super().__init__()
        self.store, self.session_id = store, session_id
        self.prefetch_steps, self.spill_tokens, self.spill_cap_bytes = prefetch_steps, spill_tokens, spill_cap_bytes
        self.spill: SpillLog | None = None
        self.fingerprint: str | None = None
        self._restores: dict[tuple[int, int], tuple[int, tuple]] = {}  # span -> (reader, fetch)
        self._restore_stats = {"restores": 0, "restored_tokens": 0, "last_restored": 0, "restore_seconds": 0.0,
                               "stall_seconds": 0.0, "last_stall_seconds": 0.0}
        self.layer_class_to_replicate = None
        self.layers = []
        self.budget, self.sinks, self.recent = budget, sinks, recent
        self.scoring = scoring
        self.limit = limit
        self._step = 0
        self.renumbers = 0
        self.next_physical = 0
        self.rotary: list[RotaryParams] = []
        self.binding: Binding | None = None
        self._release = None
        self._chunk = None
        self.progress = None  # optional: anything with update(n), told of every prefilled chunk
        if model is not None:
            self.bind(model)

    # -- the agent's step ----------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """The agent's current step: planned spans read at or after it keep their foresight bonus."""
        return self._step

    @step.setter
    def step(self, value) -> None:
        value = as_index(value, "cache.step")
        if value < 0:
            raise ValueError(f"cache.step must be >= 0, got {value}")
        self._step = value
        self._plan_restores()

    @property
    def bounded(self) -> bool:
        return self.limit is not None

    @property
    def blueprint(self) -> Blueprint | None:
        """The blueprint of the foresight policy, if the scoring has one."""
        return self.scoring.blueprint

    # -- binding to a model ------------------------------------------------------------------------
    def bind(self, model) -> "EvictionCache":
        """Install the hooks and the ``pace_sdpa`` attention on ``model`` (shared with other caches
        bound to it). Undo with :meth:`unbind`; a garbage-collected cache unbinds itself."""
        if self.binding is not None:
            if self.binding.model_ref() is model:
                return self
            raise RuntimeError(f"this {type(self).__name__} is already bound to another model; unbind() it first")
        config = model.config.get_text_config(decoder=True)
        self._check_model(model, config)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        if self.bounded:
            rope = getattr(config, "rope_parameters", None) or {}
            nested = is_nested(rope)
            self.rotary = [RotaryParams.from_config(config, layer_type=t if nested else None) for t in layer_types]
        if not self.layers:
            self.layers = [self.layer_class(keep_reference=self.bounded, budget=self.budget) for _ in layer_types]
        elif len(self.layers) != len(layer_types):
            raise ValueError(f"this cache holds {len(self.layers)} layers; the model has {len(layer_types)}")
        if self.store is not None and self.spill is None:
            from .tiers import model_fingerprint

            self.fingerprint = model_fingerprint(model)
            self.spill = SpillLog(self.store, self.session_id, self.fingerprint, len(self.layers), self.spill_tokens,
                                  self.spill_cap_bytes)
        self.binding = Binding.acquire(model)
        self._release = weakref.finalize(self, self.binding.release)
        return self

    @staticmethod
    def _check_model(model, config) -> None:
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None and getattr(config, "sliding_window", None) is not None:
            raise NotImplementedError(
                f"pace_hf caches support full-attention layers only; this config sets sliding_window="
                f"{config.sliding_window} (a sliding window counted over evicted positions would be wrong). "
                "Set config.sliding_window = None if the model was trained without one."
            )
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise NotImplementedError(
                f"pace_hf caches support full-attention layers only; this model has {sorted(set(layer_types))}"
            )
        impl = model.config._attn_implementation
        if impl not in ("sdpa", None, attention.ATTN_NAME):
            raise NotImplementedError(
                f"pace_hf scores attention alongside SDPA; load the model with attn_implementation='sdpa' (got {impl!r})"
            )

    def unbind(self) -> None:
        """Release the model: when no other cache is bound to it, its hooks, wrappers and attention
        implementation are removed, and it is exactly as loaded."""
        if self._release is not None:
            self._release()
        self.binding = self._release = None

    @contextlib.contextmanager
    def bound_to(self, model):
        """``with cache.bound_to(model): model.generate(..., cache=cache)``; unbinds on exit."""
        self.bind(model)
        try:
            yield self
        finally:
            self.unbind()

    # -- what transformers calls -------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self._chunk is None:
            raise RuntimeError(
                f"{type(self).__name__} is not bound to the model that uses it: pass model= to the "
                "constructor, or call cache.bind(model)"
            )
        logical_start, physical_start = self._chunk
        return self.layers[layer_idx].update(
            key_states, value_states, logical_start=logical_start, physical_start=physical_start
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].cumulative_length if self.layers else 0

    def reset(self) -> None:
        """Forget every token, as a new cache would, keeping the binding, the policy and the buffers:
        the next forward starts again at logical and rotary position 0. With a store, the spill index
        starts afresh too (the new tokens' entries overwrite the old ones)."""
        if self.in_forward:
            raise RuntimeError("reset cannot run inside a forward")
        for layer in self.layers:
            layer.reset()
        self._step = self.renumbers = self.next_physical = 0
        self._restores.clear()
        if self.spill is not None:
            self.spill = SpillLog(self.store, self.session_id, self.fingerprint, len(self.layers), self.spill_tokens,
                                  self.spill_cap_bytes)

    # -- public readings ---------------------------------------------------------------------------
    def ledger(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logical, physical) positions ``[kv_heads, n]`` of the resident tokens of ``layer_idx``, in
        the order of that layer's stored keys."""
        layer = self.layers[layer_idx]
        if layer.logical is None:
            empty = torch.empty(0, 0, dtype=torch.long)
            return empty, empty
        return layer.logical, layer.physical

    def resident_count(self) -> int:
        return self.layers[0].resident_count if self.layers else 0

    @property
    def next_position(self) -> int:
        """The rotary position the next token will get."""
        return self.next_physical if self.bounded else self.get_seq_length()

    def residency(self, positions) -> float:
        """Fraction of the given logical positions that are resident, over every layer and KV head."""
        positions = torch.as_tensor(positions, dtype=torch.long).flatten()
        if positions.numel() == 0 or not self.layers or self.layers[0].logical is None:
            return 0.0 if positions.numel() else 1.0
        hits = [torch.isin(layer.logical.cpu(), positions).sum(-1) for layer in self.layers if layer.logical is not None]
        return float(torch.cat(hits).float().mean() / positions.unique().numel())

    def rotary_gap(self, positions) -> int | None:
        """The largest rotary distance, over layers and heads, from the next query to a resident token
        of the given logical positions; None when none of them is resident."""
        positions = torch.as_tensor(positions, dtype=torch.long).flatten()
        nearest = None
        for layer in self.layers:
            if layer.logical is None:
                continue
            hit = torch.isin(layer.logical.cpu(), positions)
            if hit.any():
                low = int(layer.physical.cpu()[hit].min())
                nearest = low if nearest is None else min(nearest, low)
        return None if nearest is None else self.next_position - nearest

    # -- forward bracket (called by the hooks) -------------------------------------------------------
    @property
    def in_forward(self) -> bool:
        return self._chunk is not None

    def begin_forward(self, q_len: int) -> int:
        """Prepare for a forward of ``q_len`` new tokens; return the first physical position."""
        self._apply_due_restores()
        seen, n = self.get_seq_length(), self.resident_count()
        if q_len == 1 and self.blueprint is not None:  # decoding: the prompt ends at seen
            self.blueprint.warn_past(seen)
        if self.bounded:
            if n + q_len > self.limit:
                raise ValueError(
                    f"a forward of {q_len} tokens on {n} resident tokens cannot stay below limit={self.limit}; "
                    f"use limit > budget + chunk, e.g. prefill_chunk_size <= {self.limit - self.budget}"
                )
            if self.next_physical + q_len > self.limit:
                self.renumber()
        else:
            self.next_physical = seen
        self._chunk = (seen, self.next_physical)
        return self.next_physical

    def renumber(self) -> None:
        """Physical positions become ``0..n-1`` in logical order in every layer (keys re-rotated)."""
        for layer, params in zip(self.layers, self.rotary):
            if layer.is_initialized:
                layer.renumber(params)
        self.next_physical = self.resident_count()
        self.renumbers += 1

    def abort_forward(self) -> None:
        logical_start, _ = self._chunk
        self._chunk = None
        for layer in self.layers:
            if layer.is_initialized and layer.cumulative_length > logical_start:
                layer.drop_last(layer.cumulative_length - logical_start)

    def end_forward(self, q_len: int) -> None:
        self._chunk = None
        self.next_physical += q_len
        if self.progress is not None and q_len > 1:
            self.progress.update(q_len)
        for layer_idx, layer in enumerate(self.layers):
            if layer.is_initialized and layer.resident_count > self.budget:
                evicted = layer.keep(self._keep_index(layer), collect=self.spill is not None)
                if evicted is not None:
                    self.evicted(layer_idx, evicted)

    def evicted(self, layer_idx: int, tokens: dict[str, torch.Tensor]) -> None:
        """Every token a layer evicts (flat, see ``EvictingLayer.tokens_at``): spilled with a store,
        dropped without one."""
        if self.spill is not None:
            self.spill.add(layer_idx, tokens)

    # -- tiers: restore, prefetch, save, resume ------------------------------------------------------
    @property
    def tier_stats(self) -> dict:
        """The store's counters (per tier: bytes, hits, misses, integrity failures, errors, seconds)
        and this cache's restores: count, tokens, seconds, and the stall (seconds a forward waited)."""
        out = dict(self._restore_stats)
        if self.spill is not None:
            out["spilled_tokens"] = self.spill.spilled_tokens
            out["spill"] = dict(self.spill.stats, held_bytes=self.spill.held_bytes)
        if self.store is not None:
            out["store"] = self.store.stats
        return out

    def restore(self, start: int, end: int) -> int:
        """Bring the evicted tokens of logical range ``[start, end)`` back now, and plan the range for
        the current step so that its foresight bonus keeps it. Returns the tokens restored (layer 0)."""
        start, end = as_index(start, "start"), as_index(end, "end")
        if not 0 <= start < end:
            raise ValueError(f"restore needs 0 <= start < end, got [{start}, {end})")
        if self.spill is None:
            raise ValueError("restore needs a cache with a store (store=..., session_id=...) bound to a model")
        if self.blueprint is None:
            raise ValueError("restored tokens stay resident through their foresight bonus: restore needs a "
                             "cache with a Foresight policy (PACECache)")
        if self.in_forward:
            raise RuntimeError("restore cannot run inside a forward")
        self.blueprint.add(Span(start, end, [self.step]))
        self._restore([((start, end), self.spill.fetch(start, end))])
        return self._restore_stats["last_restored"]

    def _plan_restores(self) -> None:
        """Fetch, in the background, every planned span whose next reader is within
        ``prefetch_steps`` steps and that is not fully resident."""
        blueprint = self.blueprint
        if self.spill is None or blueprint is None or not self.layers or not self.layers[0].is_initialized:
            return
        seen = self.get_seq_length()
        for span in blueprint.due(self.step, self.prefetch_steps):
            key = (span.start, min(span.end, seen))
            if key[0] >= key[1] or key in self._restores or self.residency(range(*key)) == 1.0:
                continue
            self._restores[key] = (span.next_reader(self.step), self.spill.fetch(*key))

    def _apply_due_restores(self) -> None:
        due = [(key, fetch) for key, (reader, fetch) in self._restores.items() if reader <= self.step]
        if due:
            for key, _ in due:
                del self._restores[key]
            self._restore(due)

    def _restore(self, fetches) -> None:
        """Insert fetched tokens into every layer, evict back to ``budget`` and renumber, before the
        next chunk runs. Restored planned tokens carry their bonus, so they stay."""
        started = time.perf_counter()
        waited = 0.0
        by_layer: dict[int, list] = {}
        pages: dict = {}  # (layer, page) -> the page read whole: settled once its layer has its tokens back
        for (start, end), fetch in fetches:
            t0 = time.perf_counter()
            fetch[1].result()  # the stall: how long the forward waits for the background fetch
            waited += time.perf_counter() - t0
            tokens, whole = self.spill.collect(start, end, fetch)
            pages.update(whole)
            for layer_idx, part in tokens.items():
                by_layer.setdefault(layer_idx, []).append(part)
        restored, inserted = 0, False
        for layer_idx, parts in sorted(by_layer.items()):
            layer, tokens = self.layers[layer_idx], concat(parts)
            if not layer.is_initialized or tokens["logical"].numel() == 0:
                continue
            inserted = True
            before = [head.clone() for head in layer.logical]  # insert writes the ledger in place
            pushed = layer.insert(tokens, self.scoring, self.step, self.budget, self.sinks, self.recent)
            self.spill.settle(layer_idx, pages, layer.logical)  # what came back leaves the spill ...
            self.evicted(layer_idx, pushed)  # ... and what it pushed out is spilled
            if layer_idx == 0:
                restored = sum(int((~torch.isin(new, old)).sum()) for new, old in zip(layer.logical, before))
        if self.bounded and inserted:
            self.renumber()
        stats = self._restore_stats
        stats["restores"] += 1
        stats["restored_tokens"] += restored
        stats["last_restored"] = restored
        stats["restore_seconds"] += time.perf_counter() - started
        stats["stall_seconds"] += waited
        stats["last_stall_seconds"] = waited

    def save(self) -> str:
        """Write everything needed to continue this session to the store, as one new generation: every
        layer's tensors (resident and reference keys, ledger, scores), the step, the renumber state, the
        policy with its blueprint, and the spill index, tied together by a manifest of digests. All or
        nothing (``pace_hf.persist``): it returns the generation once it is on every durable tier, or
        raises ``SaveFailed`` / ``WriterConflict`` and the previous save stays the one ``resume`` gives."""
        return persist.save(self)

    @classmethod
    def resume(cls, session_id: str, *, store, model, scoring: ScoringPolicy | None = None) -> "EvictionCache":
        """Continue a session saved with :meth:`save`, possibly in another process, bound to ``model``.
        Every entry is checked against the save's manifest first: a session saved by another model,
        config or dtype, or with an entry missing or from another save, is refused, naming it."""
        return persist.resume(cls, session_id, store=store, model=model, scoring=scoring)[0]

    @classmethod
    def _from_manifest(cls, m: dict, states: dict, *, store, session_id: str, model,
                       scoring: ScoringPolicy | None = None) -> "EvictionCache":
        """The cache a verified save describes (``persist.resume`` checked every entry of ``states``)."""
        cache = cls.__new__(cls)
        EvictionCache.__init__(cache, budget=m["budget"], sinks=m["sinks"], recent=m["recent"],
                               scoring=scoring or rebuild(m["scoring"]), limit=m["limit"], store=store,
                               session_id=session_id, prefetch_steps=m["prefetch_steps"],
                               spill_tokens=m["spill"]["page_tokens"], spill_cap_bytes=m["spill"]["cap_bytes"])
        cache.bind(model)
        if len(m["layers"]) != len(cache.layers):
            cache.unbind()
            raise ValueError(f"session {session_id!r} has {len(m['layers'])} layers; the model has {len(cache.layers)}")
        for i, (tensors, meta) in states.items():
            cache.layers[i].load({k: v.to(model.device) for k, v in tensors.items()}, meta["seen"])
        cache.spill.load(m["spill"], m["generation"])
        cache._step, cache.renumbers, cache.next_physical = m["step"], m["renumbers"], m["next_physical"]
        return cache

    def score_query_window(self, q_len: int) -> int | None:
        return self.scoring.query_window(q_len) if self.scoring.needs_attention else 0

    def record_attention(self, layer_idx: int, column_sums: torch.Tensor) -> None:
        self.layers[layer_idx].record_scores(column_sums[0], self.scoring)  # batch 1

    def _keep_index(self, layer) -> torch.Tensor:
        """Indices ([kv_heads, budget], sorted) of the tokens to keep in ``layer``."""
        n = layer.resident_count
        if self.scoring.needs_attention and layer.scored != n:
            raise RuntimeError(
                "attention scores were not recorded for every token: the model must run its attention "
                f"through {attention.ATTN_NAME!r} (got {layer.scored} scores for {n} tokens)"
            )
        priority = self.scoring.priority(layer.logical, layer.scores, self.step)
        return keep_index(priority, min(self.budget, n), self.sinks, self.recent)

    # -- retrieval: evicted context found by what a new turn asks (pace_hf.retrieval) ----------------
    def rehydrate(self, text: str, ids, tokenizer=None, *, retriever=None) -> list[Span]:
        """Rank the evicted pages of the context against the new turn ``text`` and restore the best
        ones, within ``budget // 4`` tokens per KV head, exactly re-rotated and planned for the current
        step (see :mod:`pace_hf.retrieval`). ``ids``: the ids of everything this cache has seen (the
        cache keeps no ids). The first call builds a ``PageRetriever(tokenizer)`` (or keeps
        ``retriever``); later calls reuse it. No store, or nothing spilled: a no-op."""
        from .retrieval import PageRetriever

        if retriever is not None:
            self.retriever = retriever
        elif getattr(self, "retriever", None) is None:
            self.retriever = PageRetriever(tokenizer)
        return self.retriever.rehydrate(self, text, ids)


class H2OCache(EvictionCache):
    """Heavy-hitter oracle: keep the tokens with the most cumulative attention (plus sinks and recent).
    With ``limit`` it is the positions-only arm."""

    def __init__(self, model=None, *, budget: int = 2048, **kwargs):
        kwargs.setdefault("scoring", CumulativeAttention())
        super().__init__(model, budget=budget, **kwargs)


class PACECache(EvictionCache):
    """PACE: foresight (a bonus for the blueprint's planned spans) around H2O, with bounded positions.

    ``limit=None`` is the retention-only arm. ``scorer`` replaces H2O under the bonus (e.g.
    ``ObservationWindow()`` for SnapKV with foresight); ``bonus`` replaces ``ForesightBonus(phi)``.
    Set ``cache.step`` to the agent's current step.
    """

    def __init__(
        self,
        blueprint: Blueprint | None = None,
        model=None,
        *,
        budget: int = 2048,
        limit: int | None = 8192,
        phi: float = 1e5,
        bonus=None,
        scorer: ScoringPolicy | None = None,
        **kwargs,
    ):
        blueprint = Blueprint() if blueprint is None else blueprint
        if not isinstance(blueprint, Blueprint):
            raise TypeError(f"blueprint must be a pace_hf.Blueprint, got {type(blueprint).__name__}")
        if "scoring" in kwargs:
            raise TypeError("PACECache builds its scoring from blueprint, scorer and bonus; use EvictionCache(scoring=...)")
        foresight = Foresight(scorer or CumulativeAttention(), blueprint, bonus if bonus is not None else ForesightBonus(phi))
        super().__init__(model, budget=budget, limit=limit, scoring=foresight, **kwargs)

    @property
    def bonus(self):
        return self.scoring.bonus


class SnapKVCache(EvictionCache):
    """SnapKV: scores from the observation window of each forward's last queries, max-pooled."""

    def __init__(self, model=None, *, budget: int = 2048, window: int = 32, kernel: int = 7, **kwargs):
        super().__init__(model, budget=budget, scoring=ObservationWindow(window, kernel), **kwargs)


class StreamingLLMCache(EvictionCache):
    """StreamingLLM: attention sinks plus the most recent tokens."""

    def __init__(self, model=None, *, budget: int = 2048, sinks: int = DEFAULT_SINKS, **kwargs):
        kwargs.setdefault("recent", 0)
        super().__init__(model, budget=budget, sinks=sinks, scoring=Recency(), **kwargs)


__all__ = ["CompactingLayer", "EvictingLayer", "EvictionCache", "H2OCache", "PACECache", "SnapKVCache", "StreamingLLMCache",
           "keep_index"]
