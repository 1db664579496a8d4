"""PACE and its baselines as drop-in transformers caches.

``model.generate(ids, cache=PACECache(blueprint, model=model))`` is all a user writes
(``past_key_values=`` works too: transformers 5.24 deprecates it in ``generate`` until 6.0, and
versions before 5.24 only accept that name).

How it fits into transformers (see the README's "How it works"):
- A cache is a list of ``EvictingLayer``: plain tensors ``[batch, kv_heads, n, head_dim]`` plus an
  explicit ledger of logical and physical positions per KV head, per-token scores and, for bounded
  positions, reference keys with their reference positions.
- What to keep is a ``ScoringPolicy`` (``pace_hf.scoring``); ``limit`` (or None) switches bounded
  positions on. The ablation arms are compositions: ``H2OCache(limit=...)`` is positions-only,
  ``PACECache(limit=None)`` retention-only.
- Binding the cache to a model (``pace_hf.binding``) installs the hooks that bracket each forward:
  ``begin_forward`` renumbers when the next chunk would pass ``limit`` and hands physical positions to
  the rotary embedding; ``end_forward`` evicts down to ``budget`` at the chunk boundary, so every layer
  announces the same kv length to the mask. ``unbind()`` undoes it.
- ``get_seq_length()`` is the number of tokens seen, so ``generate`` slices new input correctly;
  ``get_mask_sizes`` announces ``stored + q`` keys, like ``DynamicSlidingWindowLayer``.
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
from .scoring import (CumulativeAttention, Foresight, ForesightBonus, ObservationWindow, Recency, ScoringPolicy,
                      describe, rebuild)
from .spill import SpillLog, concat

SAVE_FORMAT = 1
# The manifest of a saved session is readable whatever the model: it says which model saved it.
MANIFEST_KEY, MANIFEST_FINGERPRINT = "manifest", "pace-session-manifest"

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
    """Bytes held by every tensor of a cache's layers: keys and values and, for the eviction caches,
    reference keys, ledger and scores (storage shared by two of them counts once). Works for any
    transformers cache with ``layers``; it is what a memory comparison against DynamicCache reads."""
    seen, total = set(), 0
    for layer in getattr(cache, "layers", []):
        for value in vars(layer).values():
            if torch.is_tensor(value) and value.numel() and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
    return total


def _flat_rows(index: torch.Tensor, n: int) -> torch.Tensor:
    """Per-head token indices ``[kv_heads, m]`` as rows of a ``[kv_heads * n, d]`` view."""
    offsets = torch.arange(index.shape[0], device=index.device)[:, None] * n
    return (index + offsets).reshape(-1)


def _take_rows(states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``states`` ([1, kv_heads, n, d]) at the flat ``rows``: one ``index_select`` of whole rows. Why:
    ``gather`` with an index expanded over d copies element by element, about 10x slower, and a
    decode step evicts (so compacts every layer) once per token."""
    _, heads, n, d = states.shape
    return states.reshape(heads * n, d).index_select(0, rows).view(1, heads, -1, d)


class EvictingLayer(DynamicLayer):
    """One layer's resident tokens, ledger and scores. Batch size 1.

    Stored tokens are kept in logical order per KV head (eviction gathers sorted indices; new tokens
    are appended), so the ledger's columns follow the stored keys.
    """

    def __init__(self, keep_reference: bool):
        super().__init__()
        self.keep_reference = keep_reference
        self.seen = 0
        self.logical = self.physical = self.scores = None
        self.ref_keys = self.ref_pos = None

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        heads, dev = key_states.shape[1], key_states.device
        self.logical = torch.empty(heads, 0, dtype=torch.long, device=dev)
        self.physical = torch.empty(heads, 0, dtype=torch.long, device=dev)
        self.scores = torch.empty(heads, 0, dtype=torch.float32, device=dev)
        if self.keep_reference:
            self.ref_keys = self.keys
            self.ref_pos = self.physical

    # -- the transformers layer contract -------------------------------------------------------
    def update(self, key_states, value_states, *args, logical_start=None, physical_start=None, **kwargs):
        if logical_start is None:
            raise RuntimeError("EvictingLayer.update needs chunk positions; call it through its cache")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q, heads, dev = key_states.shape[-2], key_states.shape[1], key_states.device
        new_logical = torch.arange(logical_start, logical_start + q, device=dev).expand(heads, q)
        new_physical = torch.arange(physical_start, physical_start + q, device=dev).expand(heads, q)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.logical = torch.cat([self.logical, new_logical], dim=-1)
        self.physical = torch.cat([self.physical, new_physical], dim=-1)
        if self.keep_reference:  # keys arrive rotated at their physical position: that is the reference
            self.ref_keys = torch.cat([self.ref_keys, key_states], dim=-2)
            self.ref_pos = torch.cat([self.ref_pos, new_physical], dim=-1)
        self.seen += q
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.stored
        return stored + query_length, self.seen - stored

    @property
    def stored(self) -> int:
        return 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("pace_hf caches do not support beam search yet (num_beams must be 1)")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("pace_hf caches hold one sequence; batch expansion is not supported")

    def batch_select_indices(self, indices):
        raise NotImplementedError("pace_hf caches hold one sequence; batch selection is not supported")

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("pace_hf caches cannot be cropped (assisted decoding is not supported)")

    # -- eviction, restore and renumbering -----------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every per-token tensor of the layer (for save and for bit-exact checks)."""
        out = {"keys": self.keys, "values": self.values, "logical": self.logical,
               "physical": self.physical, "scores": self.scores}
        if self.keep_reference:
            out.update(ref_keys=self.ref_keys, ref_pos=self.ref_pos)
        return out

    def load(self, tensors: dict[str, torch.Tensor], seen: int) -> None:
        for name, value in tensors.items():
            setattr(self, name, value)
        self.is_initialized = True
        self.dtype, self.device = self.keys.dtype, self.keys.device
        self.seen = seen

    def tokens_at(self, head: torch.Tensor, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stored tokens at (head, slot) pairs, flat, as a spill entry holds them: what an exact
        restore needs (value, reference key and position, logical position, score)."""
        ref_keys = self.ref_keys if self.keep_reference else self.keys
        ref_pos = self.ref_pos if self.keep_reference else self.physical
        scores = self.scores[head, pos] if self.scores.numel() else torch.zeros(head.shape, dtype=torch.float32, device=head.device)
        return {"head": head, "logical": self.logical[head, pos], "ref_pos": ref_pos[head, pos],
                "score": scores, "ref_key": ref_keys[0, head, pos], "value": self.values[0, head, pos]}

    def keep(self, index: torch.Tensor, collect: bool = True) -> dict[str, torch.Tensor] | None:
        """Keep the tokens at ``index`` ([kv_heads, m], sorted per head); return the dropped ones flat
        (when ``collect``: only a cache that spills needs them)."""
        evicted = None
        if collect:
            dropped = torch.ones(self.logical.shape, dtype=torch.bool, device=index.device)
            dropped.scatter_(1, index, False)
            evicted = self.tokens_at(*dropped.nonzero(as_tuple=True))
        rows = _flat_rows(index, self.keys.shape[-2])
        self.keys = _take_rows(self.keys, rows)
        self.values = _take_rows(self.values, rows)
        self.logical = self.logical.gather(1, index)
        self.physical = self.physical.gather(1, index)
        if self.scores.numel():  # policies that score from positions keep no scores
            self.scores = self.scores.gather(1, index)
        if self.keep_reference:
            self.ref_keys = _take_rows(self.ref_keys, rows)
            self.ref_pos = self.ref_pos.gather(1, index)
        return evicted

    def drop_last(self, count: int) -> None:
        """Forget the ``count`` newest tokens (the partial writes of a failed forward)."""
        keep = self.stored - count
        self.keys, self.values = self.keys[:, :, :keep], self.values[:, :, :keep]
        self.logical, self.physical = self.logical[:, :keep], self.physical[:, :keep]
        self.scores = self.scores[:, : min(keep, self.scores.shape[-1])]
        if self.keep_reference:
            self.ref_keys, self.ref_pos = self.ref_keys[:, :, :keep], self.ref_pos[:, :keep]
        self.seen -= count

    def insert(self, tokens: dict[str, torch.Tensor], priority, budget: int, sinks: int, recent: int) -> dict[str, torch.Tensor]:
        """Insert restored ``tokens`` (flat, as ``tokens_at`` gives them) in logical order, then keep the
        ``budget`` tokens of highest ``priority(view)`` per head, where ``view`` has one head's
        ``logical`` and ``scores`` as ``[1, n]``. Returns the resident tokens pushed out, flat.

        A restored token comes back with its reference key and position, and its stored key is that
        reference: unbounded layers keep keys at their logical position, and the caller renumbers
        bounded layers, which re-rotates every key from its reference."""
        dev, has_scores = self.logical.device, self.scores.numel() > 0
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
                    "score": self.scores[h] if has_scores else torch.zeros(resident.shape, device=dev)}
            cand = {k: torch.cat([v, tokens[k][sel].to(dev, v.dtype)]) for k, v in cand.items()}
            was_resident = torch.arange(cand["logical"].numel(), device=dev) < resident.numel()
            order = cand["logical"].argsort()
            candidates.append(({k: v[order] for k, v in cand.items()}, was_resident[order]))
        keep = min(budget, min(c["logical"].numel() for c, _ in candidates))  # every head keeps as many
        rows, pushed = [], []
        for h, (cand, was_resident) in enumerate(candidates):
            view = _HeadView(cand["logical"][None], cand["score"][None] if has_scores else None)
            index = keep_index(priority(view), keep, sinks, recent)[0]
            out = was_resident.clone()
            out[index] = False
            pushed.append({"head": torch.full((int(out.sum()),), h, dtype=torch.long), **{k: v[out] for k, v in cand.items()}})
            rows.append({k: v[index] for k, v in cand.items()})
        stack = lambda name: torch.stack([r[name] for r in rows])  # noqa: E731
        self.logical, self.values = stack("logical"), stack("value")[None]
        self.keys, self.physical = stack("ref_key")[None], stack("ref_pos")
        if has_scores:
            self.scores = stack("score")
        if self.keep_reference:
            self.ref_keys, self.ref_pos = self.keys, self.physical
        return {k: torch.cat([p[k] for p in pushed]) for k in pushed[0]}

    def renumber(self, params: RotaryParams) -> None:
        """Physical positions become 0..n-1 in logical order; keys are re-rotated from the reference."""
        n = self.stored
        self.physical = torch.arange(n, device=self.keys.device).expand(self.physical.shape[0], n).contiguous()
        self.keys = rerotate(self.ref_keys, self.ref_pos[None], self.physical[None], params, out_dtype=self.keys.dtype)


class _HeadView:
    """What a scoring policy reads of a layer (``logical``, ``scores``), for one head's candidates."""

    def __init__(self, logical: torch.Tensor, scores: torch.Tensor | None):
        self.logical, self.scores = logical, scores


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
            session there. ``spill_tokens``: tokens per KV head in one spill entry.
    """

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
        spill_tokens: int = 256,
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
        super().__init__()
        self.store, self.session_id = store, session_id
        self.prefetch_steps, self.spill_tokens = prefetch_steps, spill_tokens
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
        policy = self.scoring
        while policy is not None:
            if isinstance(policy, Foresight):
                return policy.blueprint
            policy = getattr(policy, "inner", None)
        return None

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
            self.layers = [EvictingLayer(keep_reference=self.bounded) for _ in layer_types]
        elif len(self.layers) != len(layer_types):
            raise ValueError(f"this cache holds {len(self.layers)} layers; the model has {len(layer_types)}")
        if self.store is not None and self.spill is None:
            from .tiers import model_fingerprint

            self.fingerprint = model_fingerprint(model)
            self.spill = SpillLog(self.store, self.session_id, self.fingerprint, len(self.layers), self.spill_tokens)
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
        return self.layers[layer_idx].seen if self.layers else 0

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
        return self.layers[0].stored if self.layers else 0

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
            if layer.is_initialized and layer.seen > logical_start:
                layer.drop_last(layer.seen - logical_start)

    def end_forward(self, q_len: int) -> None:
        self._chunk = None
        self.next_physical += q_len
        if self.progress is not None and q_len > 1:
            self.progress.update(q_len)
        for layer_idx, layer in enumerate(self.layers):
            if layer.is_initialized and layer.stored > self.budget:
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
        for (start, end), fetch in fetches:
            t0 = time.perf_counter()
            fetch[1].result()  # the stall: how long the forward waits for the background fetch
            waited += time.perf_counter() - t0
            for layer_idx, tokens in self.spill.collect(start, end, fetch).items():
                by_layer.setdefault(layer_idx, []).append(tokens)
        restored, inserted = 0, False
        for layer_idx, parts in sorted(by_layer.items()):
            layer, tokens = self.layers[layer_idx], concat(parts)
            if not layer.is_initialized or tokens["logical"].numel() == 0:
                continue
            inserted = True
            before = layer.logical
            pushed = layer.insert(tokens, lambda view: self.scoring.priority(view, self.step),
                                  self.budget, self.sinks, self.recent)
            self.evicted(layer_idx, pushed)
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

    def save(self) -> None:
        """Write everything needed to continue this session to the store, durably: every layer's
        tensors (resident and reference keys, ledger, scores), the step, the renumber state, the
        policy with its blueprint, and the spill index. ``resume`` continues it in another process."""
        if self.spill is None:
            raise ValueError("save needs a cache with a store (store=..., session_id=...) bound to a model")
        if self.in_forward:
            raise RuntimeError("save cannot run inside a forward")
        self.spill.flush()
        for i, layer in enumerate(self.layers):
            if layer.is_initialized:
                self.store.put(f"L{i}/state", layer.tensors(), {"seen": layer.seen},
                               fingerprint=self.fingerprint, session_id=self.session_id)
        manifest = {
            "format": SAVE_FORMAT, "class": type(self).__name__, "model_fingerprint": self.fingerprint,
            "layers": [layer.is_initialized for layer in self.layers], "budget": self.budget,
            "sinks": self.sinks, "recent": self.recent, "limit": self.limit, "scoring": describe(self.scoring),
            "step": self.step, "renumbers": self.renumbers, "next_physical": self.next_physical,
            "prefetch_steps": self.prefetch_steps, "spill": self.spill.state(),
        }
        self.store.put(MANIFEST_KEY, {}, manifest, fingerprint=MANIFEST_FINGERPRINT, session_id=self.session_id)
        self.store.flush()

    @classmethod
    def resume(cls, session_id: str, *, store, model, scoring: ScoringPolicy | None = None) -> "EvictionCache":
        """Continue a session saved with :meth:`save`, possibly in another process, bound to ``model``.
        A session saved by another model, config or dtype is refused."""
        from .tiers import model_fingerprint

        got = store.get(MANIFEST_KEY, fingerprint=MANIFEST_FINGERPRINT, session_id=session_id)
        if got is None:
            raise KeyError(f"no saved session {session_id!r} in this store (or its manifest failed verification)")
        m = got[1]
        if m.get("format") != SAVE_FORMAT:
            raise ValueError(f"session {session_id!r} was saved in format {m.get('format')}; this is {SAVE_FORMAT}")
        fingerprint = model_fingerprint(model)
        if m["model_fingerprint"] != fingerprint:
            raise ValueError(f"session {session_id!r} was saved by another model, config or dtype "
                             f"(fingerprint {m['model_fingerprint']}, this model {fingerprint}): its KV cannot be restored")
        cache = cls.__new__(cls)
        EvictionCache.__init__(cache, budget=m["budget"], sinks=m["sinks"], recent=m["recent"],
                               scoring=scoring or rebuild(m["scoring"]), limit=m["limit"], store=store,
                               session_id=session_id, prefetch_steps=m["prefetch_steps"],
                               spill_tokens=m["spill"]["entry_tokens"])
        cache.bind(model)
        if len(m["layers"]) != len(cache.layers):
            raise ValueError(f"session {session_id!r} has {len(m['layers'])} layers; the model has {len(cache.layers)}")
        for i, (layer, saved) in enumerate(zip(cache.layers, m["layers"])):
            if not saved:
                continue
            state = store.get(f"L{i}/state", fingerprint=fingerprint, session_id=session_id)
            if state is None:
                raise ValueError(f"session {session_id!r}: layer {i}'s state is missing or failed verification")
            layer.load({k: v.to(model.device) for k, v in state[0].items()}, state[1]["seen"])
        cache.spill.load(m["spill"])
        cache._step, cache.renumbers, cache.next_physical = m["step"], m["renumbers"], m["next_physical"]
        return cache

    def score_query_window(self, q_len: int) -> int | None:
        return self.scoring.query_window(q_len) if self.scoring.needs_attention else 0

    def record_attention(self, layer_idx: int, column_sums: torch.Tensor) -> None:
        layer = self.layers[layer_idx]
        fresh = column_sums[0]  # batch 1
        n_new = fresh.shape[-1] - layer.scores.shape[-1]
        layer.scores = self.scoring.accumulate(layer.scores, fresh, n_new)

    def _keep_index(self, layer) -> torch.Tensor:
        """Indices ([kv_heads, budget], sorted) of the tokens to keep in ``layer``."""
        n = layer.logical.shape[-1]
        if self.scoring.needs_attention and layer.scores.shape[-1] != n:
            raise RuntimeError(
                "attention scores were not recorded for every token: the model must run its attention "
                f"through {attention.ATTN_NAME!r} (got {layer.scores.shape[-1]} scores for {n} tokens)"
            )
        priority = self.scoring.priority(layer, self.step)
        return keep_index(priority, min(self.budget, n), self.sinks, self.recent)


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


__all__ = ["EvictingLayer", "EvictionCache", "H2OCache", "PACECache", "SnapKVCache", "StreamingLLMCache",
           "keep_index"]
