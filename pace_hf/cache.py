"""PACE and its baselines as drop-in transformers caches.

``model.generate(ids, past_key_values=PACECache(blueprint, model=model))`` is all a user writes.

How it fits into transformers (see the README's "How it works"):
- Each layer is an ``EvictingLayer``: plain tensors ``[batch, kv_heads, n, head_dim]`` plus an explicit
  ledger of logical and physical positions per KV head, per-token scores and, for bounded positions,
  reference keys with their reference positions.
- Binding the cache to a model installs forward hooks on the decoder and switches attention to the
  registered ``pace_sdpa`` function (SDPA output, plus column sums for the scores). The pre-hook
  renumbers when the next chunk would pass ``limit`` and replaces the ``position_ids`` that reach the
  rotary embedding with physical positions; the post-hook evicts down to ``budget`` at the chunk
  boundary, so every layer announces the same kv length to the mask.
- ``get_seq_length()`` is the number of tokens seen, so ``generate`` slices new input correctly;
  ``get_mask_sizes`` announces ``stored + q`` keys, like ``DynamicSlidingWindowLayer``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from . import attention
from .blueprint import BonusFn, Blueprint, ForesightBonus
from .rope import RotaryParams, rerotate
from .scoring import CumulativeAttention, ObservationWindow, Recency

DEFAULT_SINKS = 4
DEFAULT_RECENT = 128


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

    def get_max_length(self) -> int:
        return -1

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

    # -- eviction and renumbering ----------------------------------------------------------------
    def keep(self, index: torch.Tensor) -> None:
        """Keep the tokens at ``index`` ([kv_heads, m], sorted per head), drop the rest."""
        gather = index[None, :, :, None].expand(self.keys.shape[0], -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, gather)
        self.values = self.values.gather(2, gather.expand(-1, -1, -1, self.values.shape[-1]))
        self.logical = self.logical.gather(1, index)
        self.physical = self.physical.gather(1, index)
        if self.scores.numel():  # policies that score from positions keep no scores
            self.scores = self.scores.gather(1, index)
        if self.keep_reference:
            self.ref_keys = self.ref_keys.gather(2, gather)
            self.ref_pos = self.ref_pos.gather(1, index)

    def drop_last(self, count: int) -> None:
        """Forget the ``count`` newest tokens (the partial writes of a failed forward)."""
        keep = self.stored - count
        self.keys, self.values = self.keys[:, :, :keep], self.values[:, :, :keep]
        self.logical, self.physical = self.logical[:, :keep], self.physical[:, :keep]
        self.scores = self.scores[:, : min(keep, self.scores.shape[-1])]
        if self.keep_reference:
            self.ref_keys, self.ref_pos = self.ref_keys[:, :, :keep], self.ref_pos[:, :keep]
        self.seen -= count

    def renumber(self, params: RotaryParams) -> None:
        """Physical positions become 0..n-1 in logical order; keys are re-rotated from the reference."""
        n = self.stored
        self.physical = torch.arange(n, device=self.keys.device).expand(self.physical.shape[0], n).contiguous()
        self.keys = rerotate(self.ref_keys, self.ref_pos[None], self.physical[None], params, out_dtype=self.keys.dtype)


class EvictionCache(DynamicCache):
    """The shared base: budget, scoring policy, foresight bonus and bounded positions.

    Every arm of the 2x2 ablation is this class with a part switched on or off, so they share the
    prefill schedule, the eviction schedule and the decode path.

    Args:
        model: the model to bind to (installs hooks and the ``pace_sdpa`` attention function).
        budget: resident tokens kept per layer and KV head after each forward.
        sinks / recent: the first ``sinks`` and the last ``recent`` tokens are never evicted.
        scoring: an eviction scoring policy from ``pace_hf.scoring``.
        blueprint / foresight / bonus: planned spans get ``bonus(next_reader, step)`` added to their score.
        bounded / limit: keep every rotary position below ``limit`` by renumbering residents.
    """

    def __init__(
        self,
        model=None,
        *,
        budget: int = 2048,
        sinks: int = DEFAULT_SINKS,
        recent: int = DEFAULT_RECENT,
        scoring=None,
        blueprint: Blueprint | None = None,
        foresight: bool = False,
        bonus: BonusFn | None = None,
        bounded: bool = False,
        limit: int | None = None,
    ):
        if budget <= 0 or sinks < 0 or recent < 0:
            raise ValueError(f"budget must be > 0 and sinks, recent >= 0 (got {budget}, {sinks}, {recent})")
        if budget < sinks + recent:
            raise ValueError(f"budget {budget} cannot hold the protected sinks + recent = {sinks} + {recent} tokens")
        if blueprint is not None and not isinstance(blueprint, Blueprint):
            raise TypeError(f"blueprint must be a pace_hf.Blueprint, got {type(blueprint).__name__}")
        if foresight and blueprint is None:
            raise ValueError("foresight=True needs a blueprint")
        if bounded and limit is None:
            raise ValueError("bounded=True needs a limit")
        if bounded and limit <= budget:
            raise ValueError(f"limit {limit} must exceed budget {budget} plus the chunk size")
        super().__init__()
        self.layer_class_to_replicate = None
        self.layers = []
        self.budget, self.sinks, self.recent = budget, sinks, recent
        self.scoring = scoring if scoring is not None else CumulativeAttention()
        self.blueprint = blueprint or Blueprint()
        self.foresight = foresight
        self.bonus = bonus if bonus is not None else ForesightBonus()
        self.bounded, self.limit = bounded, limit
        self.step = 0
        self.renumbers = 0
        self.next_physical = 0
        self.rotary: list[RotaryParams] = []
        self._chunk = None
        if model is not None:
            self.bind(model)

    # -- binding to a model ------------------------------------------------------------------------
    def bind(self, model) -> "EvictionCache":
        """Install the hooks and the ``pace_sdpa`` attention on ``model`` (idempotent per model)."""
        config = model.config.get_text_config(decoder=True)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        if any(t != "full_attention" for t in layer_types):
            raise NotImplementedError(
                f"pace_hf caches support full-attention layers only; this model has {sorted(set(layer_types))}"
            )
        rope = getattr(config, "rope_parameters", None) or {}
        nested = bool(rope) and all(isinstance(v, dict) for v in rope.values())
        self.rotary = [RotaryParams.from_config(config, layer_type=t if nested else None) for t in layer_types]
        self.layers = [EvictingLayer(keep_reference=self.bounded) for _ in layer_types]
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        name = attention.register()
        if model.config._attn_implementation != name:
            if model.config._attn_implementation not in ("sdpa", None):
                raise NotImplementedError(
                    f"pace_hf scores attention alongside SDPA; load the model with attn_implementation='sdpa' "
                    f"(got {model.config._attn_implementation!r})"
                )
            model.set_attn_implementation(name)
        if not getattr(decoder, "_pace_hf_hooked", False):  # one pair of hooks serves every cache
            decoder.register_forward_pre_hook(_pre_forward, with_kwargs=True)
            decoder.register_forward_hook(_post_forward, with_kwargs=True, always_call=True)
            decoder._pace_hf_hooked = True
        return self

    # -- what transformers calls -------------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self._chunk is None:
            raise RuntimeError(
                f"{type(self).__name__} must be bound to the model that uses it: pass model= to the constructor"
            )
        logical_start, physical_start = self._chunk
        return self.layers[layer_idx].update(
            key_states, value_states, logical_start=logical_start, physical_start=physical_start
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen if self.layers else 0

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

    # -- forward bracket (called by the hooks) -------------------------------------------------------
    def begin_forward(self, q_len: int) -> int:
        """Prepare for a forward of ``q_len`` new tokens; return the first physical position."""
        seen, n = self.get_seq_length(), self.resident_count()
        if self.bounded:
            if n + q_len > self.limit:
                raise ValueError(
                    f"a forward of {q_len} tokens on {n} resident tokens cannot stay below limit={self.limit}; "
                    f"use limit > budget + chunk, e.g. prefill_chunk_size <= {self.limit - self.budget}"
                )
            if self.next_physical + q_len > self.limit:
                for layer, params in zip(self.layers, self.rotary):
                    if layer.is_initialized:
                        layer.renumber(params)
                self.next_physical = n
                self.renumbers += 1
        else:
            self.next_physical = seen
        self._chunk = (seen, self.next_physical)
        return self.next_physical

    def abort_forward(self) -> None:
        logical_start, _ = self._chunk
        self._chunk = None
        for layer in self.layers:
            if layer.is_initialized and layer.seen > logical_start:
                layer.drop_last(layer.seen - logical_start)

    def end_forward(self, q_len: int) -> None:
        self._chunk = None
        self.next_physical += q_len
        for layer in self.layers:
            if layer.is_initialized and layer.stored > self.budget:
                layer.keep(self._keep_index(layer))

    def score_query_window(self, q_len: int) -> int | None:
        return self.scoring.query_window(q_len) if self.scoring.needs_attention else 0

    def record_attention(self, layer_idx: int, column_sums: torch.Tensor) -> None:
        layer = self.layers[layer_idx]
        fresh = column_sums[0]  # batch 1
        n_new = fresh.shape[-1] - layer.scores.shape[-1]
        layer.scores = self.scoring.update(layer.scores, fresh, n_new)

    def _keep_index(self, layer: EvictingLayer) -> torch.Tensor:
        """Indices ([kv_heads, budget], sorted) of the tokens to keep in ``layer``."""
        n = layer.stored
        if self.scoring.needs_attention:
            if layer.scores.shape[-1] != n:
                raise RuntimeError(
                    "attention scores were not recorded for every token: the model must run its attention "
                    f"through {attention.ATTN_NAME!r} (got {layer.scores.shape[-1]} scores for {n} tokens)"
                )
            score = layer.scores.clone()
        else:
            score = self.scoring.static_scores(layer.logical)
        if self.foresight:
            score = score + self.blueprint.bonus(layer.logical, self.step, self.bonus)
        position = torch.arange(n, device=score.device)
        protected = (position < self.sinks) | (position >= n - self.recent)
        score = score.masked_fill(protected[None, :], float("inf"))
        index = score.topk(self.budget, dim=-1, sorted=False).indices
        return index.sort(dim=-1).values


def _cache_from_kwargs(kwargs):
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _query_tokens(args, kwargs) -> torch.Tensor:
    """The decoder's input (ids or embeddings): ``[batch, q_len, ...]``."""
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    return args[0] if tokens is None and args else tokens


def _pre_forward(module, args, kwargs):
    cache = _cache_from_kwargs(kwargs)
    if not isinstance(cache, EvictionCache):
        return None
    tokens = _query_tokens(args, kwargs)
    batch, q_len = tokens.shape[0], tokens.shape[1]
    if batch != 1:
        raise NotImplementedError(
            f"pace_hf caches hold one sequence (batch size 1, num_beams=1); got batch size {batch}"
        )
    start = cache.begin_forward(q_len)
    kwargs["position_ids"] = torch.arange(start, start + q_len, device=tokens.device)[None]
    attention.ACTIVE_CACHE.set(cache)
    return args, kwargs


def _post_forward(module, args, kwargs, output):
    attention.ACTIVE_CACHE.set(None)
    cache = _cache_from_kwargs(kwargs)
    if not isinstance(cache, EvictionCache) or cache._chunk is None:
        return None
    if output is None:  # the forward raised: undo its partial writes so nothing is lost
        cache.abort_forward()
        return None
    cache.end_forward(_query_tokens(args, kwargs).shape[1])
    return None


class H2OCache(EvictionCache):
    """Heavy-hitter oracle: keep the tokens with the most cumulative attention (plus sinks and recent)."""

    def __init__(self, model=None, *, budget: int = 2048, **kwargs):
        super().__init__(model, budget=budget, scoring=CumulativeAttention(), **kwargs)


class PACECache(H2OCache):
    """PACE: H2O plus a foresight bonus for planned spans and bounded rotary positions.

    ``foresight=False`` and/or ``bounded=False`` give the ablation arms (positions-only,
    retention-only, H2O) on the very same code path. Set ``cache.step`` to the agent's current step.
    """

    def __init__(
        self,
        blueprint: Blueprint,
        model=None,
        *,
        budget: int = 2048,
        limit: int = 8192,
        phi: float = 1e5,
        foresight: bool = True,
        bounded: bool = True,
        bonus: BonusFn | None = None,
        **kwargs,
    ):
        super().__init__(
            model,
            budget=budget,
            blueprint=blueprint,
            foresight=foresight,
            bonus=bonus if bonus is not None else ForesightBonus(phi),
            bounded=bounded,
            limit=limit if bounded else None,
            **kwargs,
        )


class SnapKVCache(EvictionCache):
    """SnapKV: scores from the observation window of each forward's last queries, max-pooled."""

    def __init__(self, model=None, *, budget: int = 2048, window: int = 32, kernel: int = 7, **kwargs):
        super().__init__(model, budget=budget, scoring=ObservationWindow(window, kernel), **kwargs)


class StreamingLLMCache(EvictionCache):
    """StreamingLLM: attention sinks plus the most recent tokens."""

    def __init__(self, model=None, *, budget: int = 2048, sinks: int = DEFAULT_SINKS, **kwargs):
        kwargs.setdefault("recent", 0)
        super().__init__(model, budget=budget, sinks=sinks, scoring=Recency(), **kwargs)
