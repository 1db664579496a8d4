"""``EvictionCache``: a list of ``EvictingLayer`` that transformers drives, bracketed by the binding.

It validates its settings, binds to a model (``pace_hf.binding``), answers transformers' cache
contract, gives readings (ledger, residency, rotary gap) and runs the forward bracket (renumber before,
evict after). What it evicts it tells its memory (``cache.memory``, a ``pace_hf.memory.wing.KVMemory``),
which spills it, restores planned spans and saves and resumes the session; this module imports nothing
from ``pace_hf.memory``.
"""

from __future__ import annotations

import contextlib
import copy
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from .. import attention
from ..binding import Binding, check_not_compiled
from ..blueprint import Blueprint, Span, as_index
from ..rope import RotaryParams, trained_positions
from ..scoring import CumulativeAttention, ScoringPolicy, rebuild
from .batch import CacheRows, FixedRows
from .latent import latent_layer
from .layer import EvictingLayer
from .layout import LayerSpec, describe, layer_specs
from .probe import read_layers
from .quotas import DEFAULT_RECENT, DEFAULT_SINKS, Quotas
from .window import RecurrentLayer, WindowLayer


AUTO_LIMIT = "auto"  # ``limit="auto"``: the model's trained positions, read at bind


def _checked_limit(limit, budget: int, origin: str = "") -> int:
    """``limit`` as an int that leaves room above ``budget`` for a forward's chunk, else a clear error;
    ``origin`` says where a limit the caller did not write came from."""
    if isinstance(limit, str):
        raise TypeError(f'limit must be an int, None (unbounded) or "auto", got {limit!r}')
    limit = as_index(limit, "limit")
    if limit <= budget:
        raise ValueError(
            f"limit={limit}{origin} leaves no room above budget={budget}: positions run 0..limit-1, and a forward of "
            f"C new tokens on {budget} resident ones needs limit >= {budget} + C (C: prefill_chunk_size when "
            "generate prefills in chunks, else the whole prompt; 1 for each decoded token); e.g. "
            f"limit={budget + 4096} for prefill_chunk_size=4096, or budget <= {limit} - C")
    return limit


class EvictionCache(FixedRows, DynamicCache):
    """The shared base: a token budget, a scoring policy and, with ``limit``, bounded positions.

    Every arm of the 2x2 ablation is this class with another policy or limit, so they share the
    prefill schedule, the eviction schedule and the decode path.

    Args:
        model: the model to bind to (installs hooks and the ``pace_attention`` attention function).
        budget: resident tokens kept per layer and KV head after each forward.
        sinks / recent: the first ``sinks`` and the last ``recent`` tokens are never evicted.
        scoring: a ``pace_hf.scoring.ScoringPolicy`` (default ``CumulativeAttention()``, H2O).
        limit: keep every rotary position below ``limit`` by renumbering residents (None: unbounded).
            It must be at least ``budget`` plus the largest chunk a forward brings (positions run
            ``0..limit-1``); on a hybrid model, the most tokens any layer holds (a sliding window) plus it.
            ``"auto"``: the model's trained positions (``pace_hf.rope.trained_positions``: its
            ``max_position_embeddings``, capped by a switching RoPE's switch length), read when the cache
            binds; unbounded where the config states none.
        store / session_id: a ``pace_hf.tiers.TieredStore``: every evicted token is spilled to it, and
            planned spans that are not resident are restored when their reader step comes (fetched
            ``prefetch_steps`` steps ahead, in the background). ``save()`` / ``resume()`` persist the
            session there. ``spill_tokens``: logical positions per spill page (a restore reads the pages
            its span covers); ``spill_cap_bytes``: the most spilled bytes the session holds (least
            recently used pages go first; see ``pace_hf.memory.spill``).
        memory: the session's memory (a ``pace_hf.memory.wing.KVMemory``, which holds the store and the
            knobs above), when the session builds it (``PACESession`` does); without it, a cache builds its
            own from ``store`` and the knobs.

    A compiled model (``torch.compile(model.forward)``, ``model.compile()``) is refused, at bind and at
    generate: the hooks, the cache and ``pace_attention`` break the graph at every layer, and the
    cache's counters change every forward, so a compiled forward gains nothing. Run it uncompiled.
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
        limit: int | str | None = None,
        store=None,
        session_id: str | None = None,
        prefetch_steps: int = 1,
        spill_tokens: int = 64,
        spill_cap_bytes: int | None = None,
        memory=None,
    ):
        quotas = Quotas(budget, sinks, recent)
        budget = quotas.budget
        scoring = scoring if scoring is not None else CumulativeAttention()
        if not isinstance(scoring, ScoringPolicy):
            raise TypeError(f"scoring must be a pace_hf.scoring.ScoringPolicy, got {type(scoring).__name__}")
        if limit is not None and not (isinstance(limit, str) and limit == AUTO_LIMIT):
            limit = _checked_limit(limit, budget)
        if memory is not None:  # the session's own (PACESession builds it): the store and its knobs are its
            given = [name for name, value, default in (("store", store, None), ("session_id", session_id, None),
                                                       ("prefetch_steps", prefetch_steps, 1),
                                                       ("spill_tokens", spill_tokens, 64),
                                                       ("spill_cap_bytes", spill_cap_bytes, None)) if value != default]
            if given:
                raise TypeError(f"memory= carries the store and its settings; {', '.join(given)} belong to it, not to "
                                "the cache")
            self.memory = memory
        else:
            self.memory = self.memory_class(store=store, session_id=session_id, prefetch_steps=prefetch_steps,
                                            spill_tokens=spill_tokens, spill_cap_bytes=spill_cap_bytes)
        self.quotas = quotas
        self.scoring = scoring
        self.limit = limit
        self._step = 0
        self.renumbers = 0
        self.next_physical = 0
        self.rotary: list[RotaryParams] = []
        self.binding: Binding | None = None
        self.layout: list[str] = []  # each layer's kind (``layout.describe``), set when the layers are built
        self._release = None
        self._filled_by = None  # the model whose KV the layers hold (a weak reference)
        self._chunk = None
        self._held = None  # None, "holding" (inside ``holding()``) or "pending" (the next forward compresses)
        self.tokens: TokenLog | None = TokenLog()  # the ids seen (None: unknown, e.g. fed embeddings or resumed)
        self.progress = None  # optional: anything with update(n), told of every prefilled chunk
        self._rows: CacheRows | None = None  # a batch's rows, built at its first forward (``bracket_for``)
        self._row_steps: list[int] | None = None  # steps per row, set before the batch's rows exist
        # Cache's own __init__ would build DynamicLayers: hand it none; bind builds them from the model's layout.
        Cache.__init__(self, layers=[])
        if model is not None:
            self.bind(model)

    memory_class = None  # set by pace_hf.memory.wing: the memory a cache builds for itself (KVMemory)

    # -- the memory's knobs and state, read through the cache ------------------------------------------
    store = property(lambda self: self.memory.store, doc="The session's ``TieredStore`` (None: nothing is kept).")
    session_id = property(lambda self: self.memory.session_id)
    prefetch_steps = property(lambda self: self.memory.prefetch_steps)
    spill_tokens = property(lambda self: self.memory.spill_tokens)
    spill_cap_bytes = property(lambda self: self.memory.spill_cap_bytes)
    spill = property(lambda self: self.memory.spill, doc="The memory's spill log (None without a store).")
    fingerprint = property(lambda self: self.memory.fingerprint)
    restores = property(lambda self: self.memory.restores)

    budget = property(lambda self: self.quotas.budget, doc="Resident tokens per evicting layer and KV head.")
    sinks = property(lambda self: self.quotas.sinks, doc="The first tokens, never evicted.")
    recent = property(lambda self: self.quotas.recent, doc="The last tokens, never evicted.")

    # -- the agent's step ----------------------------------------------------------------------------
    @property
    def step(self) -> int | list[int]:
        """The agent's current step: planned spans read at or after it keep their foresight bonus. A
        batch takes one step for every row, or a list of one per row (read back as that list)."""
        if self._rows is not None:
            steps = [row.step for row in self._rows.rows]
            return steps[0] if len(set(steps)) == 1 else steps
        return list(self._row_steps) if self._row_steps is not None else self._step

    @step.setter
    def step(self, value) -> None:
        if isinstance(value, (list, tuple)):
            steps = [_step(v) for v in value]
            if self._rows is not None:
                if len(steps) != len(self._rows.rows):
                    raise ValueError(f"{len(steps)} steps for a batch of {len(self._rows.rows)} rows: give one per row")
                for row, v in zip(self._rows.rows, steps):
                    row.step = v
            else:
                self._row_steps = steps  # the batch's rows take them when its first forward builds them
            return
        value = _step(value)
        self._step, self._row_steps = value, None
        if self._rows is not None:
            for row in self._rows.rows:
                row.step = value
        else:
            self.memory.step_set(self)

    @property
    def bounded(self) -> bool:
        return self.limit is not None

    @property
    def blueprint(self) -> Blueprint | None:
        """The blueprint of the foresight policy, if the scoring has one."""
        return self.scoring.blueprint

    # -- binding to a model ------------------------------------------------------------------------
    def bind(self, model) -> "EvictionCache":
        """Install the hooks and the ``pace_attention`` attention on ``model`` (shared with other caches
        bound to it). Undo with :meth:`unbind`; a garbage-collected cache unbinds itself."""
        if self.binding is not None:
            if self.binding.model_ref() is model:
                return self
            raise RuntimeError(f"this {type(self).__name__} is already bound to another model; unbind() it first")
        if self.get_seq_length() and (self._filled_by is None or self._filled_by() is not model):
            raise ValueError(f"this {type(self).__name__} holds {self.get_seq_length()} tokens of another model's KV, "
                             "which this model cannot read: reset() it first to reuse it, or create a new cache")
        config = model.config.get_text_config(decoder=True)
        specs = layer_specs(config)
        check_not_compiled(model)
        self._check_attention(model)
        limit = self._bound_limit(config)
        binding = Binding.acquire(model)  # the probe scores through pace_attention
        try:
            specs, rotary = read_layers(model, specs, limit is not None, limit)
        except ValueError as e:  # only a RoPE that bounded positions cannot re-rotate exactly
            binding.release()
            raise ValueError(f"{e}. Bounded positions (limit={limit}) re-rotate rotary keys exactly; with "
                             "limit=None the cache keeps positions unbounded and takes this model") from None
        except BaseException:
            binding.release()
            raise
        if self.layers and describe(specs) != self.layout:
            binding.release()
            raise ValueError(f"this cache holds the layers {_short(self.layout)}; the model has {_short(describe(specs))}")
        self.limit = limit
        self.rotary = rotary if self.bounded else []
        if not self.layers:
            self.layers = self._new_layers(specs)
        self.memory.bound(self, model)
        self.binding = binding
        self._release = weakref.finalize(self, self.binding.release)
        self._filled_by = weakref.ref(model)
        return self

    def _bound_limit(self, config) -> int | None:
        """``limit`` for the model of ``config``: ``"auto"`` becomes its trained positions (checked against
        the budget as a given limit is); any other value is already checked."""
        if not (isinstance(self.limit, str) and self.limit == AUTO_LIMIT):
            return self.limit
        trained = trained_positions(config)
        if trained is None:
            return None
        return _checked_limit(trained, self.budget, f' (limit="auto": the model\'s {trained} trained positions)')

    def _new_layers(self, specs: list[LayerSpec]) -> list:
        """One empty layer per decoder layer, of the layer's kind (``pace_hf.cache.layout``):
        ``layer_class`` for full attention (it evicts), ``WindowLayer`` for a sliding window,
        ``RecurrentLayer`` for linear attention. Reference keys are kept where positions are bounded
        and the layer has a rotary embedding."""
        self.layout = describe(specs)
        return [self._new_layer(spec) for spec in specs]

    def _new_layer(self, spec: LayerSpec):
        reference = self.bounded and spec.rope is not None
        if spec.kind == "full":
            cls = latent_layer(self.layer_class) if spec.latent else self.layer_class  # MLA: see cache.latent
            return cls(keep_reference=reference, budget=self.budget)
        if spec.kind == "sliding":
            return WindowLayer(spec.window, keep_reference=reference)
        return RecurrentLayer()

    @staticmethod
    def _check_attention(model) -> None:
        impl = model.config._attn_implementation
        if impl not in ("sdpa", "eager", None, attention.ATTN_NAME):
            raise NotImplementedError(
                f"pace_hf scores attention alongside SDPA; load the model with attn_implementation='sdpa' (or "
                f"'eager' where the model has no SDPA) (got {impl!r})"
            )

    @property
    def evicting_layers(self) -> list[tuple[int, EvictingLayer]]:
        """``(index, layer)`` of the layers that evict (full attention): where scores, foresight, spill
        and restore run. Sliding windows and linear-attention states are carried as the model keeps them."""
        return [(i, layer) for i, layer in enumerate(self.layers) if layer.evicts]

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
    @property
    def _is_user_defined(self) -> bool:
        return getattr(self, "_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        """transformers' ``generate`` marks the cache it is handed, before its first forward: the earliest
        point an unbound cache can be refused, before the prefill starts rather than deep inside it."""
        if value and self.binding is None:
            raise RuntimeError(
                f"this {type(self).__name__} is not bound to a model"
                + (" (it was unbound)" if self._filled_by is not None else "")
                + ", so generate cannot use it: bind it first, "
                f"with {type(self).__name__}(model, ...), `with cache.bound_to(model):` or cache.bind(model)"
            )
        self._user_defined = value

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self._rows is not None:
            return self._rows.update(key_states, value_states, layer_idx)
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
        """Tokens seen. Every layer has seen them all; a linear-attention layer counts none, so its
        answer is the first attention layer's (as transformers' ``Cache`` does)."""
        if self._rows is not None:  # a batch: the columns generate gave it (each row counts its own tokens)
            return self._rows.get_seq_length()
        if not self.layers:
            return 0
        seen = getattr(self.layers[layer_idx], "cumulative_length", None)
        if seen is None:
            seen = next((layer.cumulative_length for layer in self.layers if hasattr(layer, "cumulative_length")), 0)
        return seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if self._rows is not None:
            return self._rows.get_mask_sizes(query_length, layer_idx)
        return super().get_mask_sizes(query_length, layer_idx)

    def reset(self) -> None:
        """Forget every token, as a new cache would, keeping the binding, the policy and the buffers:
        the next forward starts again at logical and rotary position 0. With a store, the spill index
        starts afresh too, and the next save replaces the last one. A batch's rows go: the next forward
        may be of another batch size."""
        if self.in_forward:
            raise RuntimeError("reset cannot run inside a forward")
        if self._rows is not None:
            for row in self._rows.rows:
                row.unbind()
            self._rows = None
        for layer in self.layers:
            layer.reset()
        self._step = self.renumbers = self.next_physical = 0
        self.tokens = TokenLog()
        self.memory.reset(self)

    # -- public readings ---------------------------------------------------------------------------
    def ledger(self, layer_idx: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logical, physical) positions ``[kv_heads, n]`` of the resident tokens of ``layer_idx``, in
        the order of that layer's stored keys (a sliding window: its last ``n`` tokens; a linear-attention
        layer holds none). By default the first layer that evicts (``evicting_layers``), where the
        planned spans are kept: on a hybrid model layer 0 may be a sliding window."""
        self._one_sequence("ledger")
        if layer_idx is None:
            layer_idx = next((i for i, _ in self.evicting_layers), 0)
        layer = self.layers[layer_idx]
        if getattr(layer, "logical", None) is None:
            empty = torch.empty(0, 0, dtype=torch.long)
            return empty, empty
        physical = layer.physical
        return layer.logical, physical if physical.dim() == 2 else physical.expand_as(layer.logical)

    def resident_count(self) -> int:
        """Tokens held by the evicting (full-attention) layers; for a model with none, by its windows."""
        self._one_sequence("resident_count()")
        counts = [layer.resident_count for _, layer in self.evicting_layers]
        return counts[0] if counts else self.positions_held()

    def positions_held(self) -> int:
        """Consecutive rotary positions the resident tokens need: the most that any layer holds (a
        sliding window may hold more than the budget)."""
        self._one_sequence("positions_held()")
        return max((layer.resident_count for layer in self.layers), default=0)

    @property
    def next_position(self) -> int:
        """The rotary position the next token will get."""
        return self.next_physical if self.bounded else self.get_seq_length()

    def residency(self, positions) -> float:
        """Fraction of the given logical positions that are resident, over every layer and KV head."""
        self._one_sequence("residency(positions)")
        positions = _logical(positions)
        layers = [layer for _, layer in self.evicting_layers if layer.logical is not None]
        if positions.numel() == 0 or not layers:
            return 0.0 if positions.numel() else 1.0
        hits = [torch.isin(layer.logical.cpu(), positions).sum(-1) for layer in layers]
        return float(torch.cat(hits).float().mean() / positions.unique().numel())

    def rotary_gap(self, positions) -> int | None:
        """The largest rotary distance, over layers and heads, from the next query to a resident token
        of the given logical positions; None when none of them is resident."""
        self._one_sequence("rotary_gap(positions)")
        positions = _logical(positions)
        nearest = None
        for _, layer in self.evicting_layers:
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
        return self._chunk is not None or (self._rows is not None and self._rows.in_forward)

    # -- batches: one cache of one sequence per row (``pace_hf.cache.batch``) ----------------------------
    @property
    def rows(self) -> list["EvictionCache"]:
        """The caches of a batch's rows, in order (``[self]`` for one sequence): each answers its own
        readings (``cache.rows[r].ledger()``), and saves and restores its own session."""
        return self._rows.rows if self._rows is not None else [self]

    def bracket_for(self, batch: int):
        """The cache itself for a forward of one sequence; for a batch, its rows, built at the batch's first
        forward with this cache's settings (blueprint and step: shared, or one per row)."""
        expected = self._rows_expected()
        if self._rows is not None:
            if batch != len(self._rows.rows):
                raise ValueError(f"this cache holds a batch of {len(self._rows.rows)} rows, but the input has {batch}: "
                                 "reset() it (or create a new one) to run another batch")
            return self._rows
        if expected is not None and expected != batch:
            raise ValueError(f"this cache was given {expected} per-row settings (blueprints or steps), but the input "
                             f"has {batch} rows: give one per row")
        if batch == 1:
            return self
        if self.get_seq_length():
            raise ValueError(f"this cache holds one sequence of {self.get_seq_length()} tokens; a batch of {batch} cannot "
                             "continue it: reset() it (or create a new one) to start the batch")
        model = self.binding.model_ref()
        self._rows = CacheRows([self._new_row(model, r, batch) for r in range(batch)])
        return self._rows

    def _rows_expected(self) -> int | None:
        """The batch size per-row settings ask for (None: any)."""
        return len(self._row_steps) if self._row_steps is not None else None

    def _row_scoring(self, r: int) -> ScoringPolicy:
        """Row ``r``'s policy: this one (policies hold no per-sequence state), unless a subclass has one per row."""
        return self.scoring

    def _new_row(self, model, r: int, batch: int) -> "EvictionCache":
        row = EvictionCache.__new__(type(self))
        EvictionCache.__init__(row, budget=self.budget, sinks=self.sinks, recent=self.recent,
                               scoring=self._row_scoring(r), limit=self.limit, store=self.store,
                               session_id=None if self.session_id is None else f"{self.session_id}-row{r}",
                               prefetch_steps=self.prefetch_steps, spill_tokens=self.spill_tokens,
                               spill_cap_bytes=self.spill_cap_bytes)
        row.layer_class = self.layer_class
        row.bind(model)
        row.step = self._row_steps[r] if self._row_steps is not None else self._step
        row._held = self._held
        return row

    def _one_sequence(self, what: str) -> None:
        if self._rows is not None:
            raise ValueError(f"this cache holds a batch of {len(self._rows.rows)} rows: ask a row, "
                             f"cache.rows[i].{what}")

    def check_prompt(self, input_ids) -> None:
        """``generate`` is given the whole conversation and prefills what the cache has not seen: refuse an
        input that does not continue what the cache holds, instead of prefilling it again on top (a re-run
        notebook cell, a retried turn) or reusing the KV of tokens that were edited since."""
        seen = self.get_seq_length()
        if not seen or self.tokens is None or self.tokens.known < seen or input_ids.shape[0] != 1:
            return
        n = input_ids.shape[-1]
        held = self.tokens.ids(seen)
        given = input_ids[0, :seen].to(held.device, held.dtype)
        differs = (given != held[:n]).nonzero()
        fix = ("reset() the cache (or create a new one) to start over, or keep the conversation in a "
               "PACESession, whose sync() rewinds it to its first change")
        if differs.numel():
            raise ValueError(f"the input differs from what this cache holds at token {int(differs[0])} of the {seen} "
                             f"it has seen: its KV is of the old tokens and cannot be reused for edited ones; {fix}")
        if n <= seen:
            raise ValueError(f"this cache has already seen these {n} tokens (it holds {seen}): generate would prefill "
                             f"them again on top of themselves. Pass the conversation so far plus the new tokens, or "
                             f"{fix}")

    def begin_forward(self, q_len: int, ids=None) -> int:
        """Prepare for a forward of ``q_len`` new tokens; return the first physical position."""
        seen = self.get_seq_length()
        if q_len < 1:  # generate slices off what the cache has seen: the input was no longer than that
            raise ValueError(f"a forward of no new tokens: this cache has seen {seen} tokens and the input is no "
                             "longer; pass generate the whole conversation so far (the cache holds its first "
                             f"{seen} tokens), or reset() the cache to start over")
        self.memory.before_forward(self)
        n = self.positions_held()
        if q_len == 1 and self.blueprint is not None:  # decoding: the prompt ends at seen
            self.blueprint.warn_past(seen)
        elif self.blueprint is not None:
            self.blueprint.warn_larger(self.budget)
        if self.bounded and self._held is None:  # a held prompt's positions run on, unchecked
            if n + q_len > self.limit:
                raise ValueError(
                    f"a forward of {q_len} tokens on {n} resident tokens cannot stay below limit={self.limit}; "
                    f"use limit >= {n} + {q_len} = {n + q_len}, or prefill_chunk_size <= {self.limit - n}"
                )
            if self.next_physical + q_len > self.limit:
                self.renumber(q_len)
        elif not self.bounded:
            self.next_physical = seen
        for layer in self.layers:
            layer.begin_forward()
        if self.tokens is not None:  # unknown from the first forward fed embeddings, or past a gap
            self.tokens = None if ids is None else self.tokens.append(seen, ids)
        self._chunk = (seen, self.next_physical)
        return self.next_physical

    def renumber(self, q_len: int = 1) -> None:
        """Lay the residents' physical positions out again below ``limit``, in logical order, ready for a
        forward of ``q_len`` tokens, and re-rotate every key from its reference, in every layer kind. A
        full layer keeps the gaps between its residents, each capped so that they fit in ``limit`` less
        the forward and less a quarter of ``limit`` (so decoding renumbers once in ``limit / 4`` tokens);
        a sliding window shifts whole (its distances stay exactly as they were); NoPE and linear layers
        move no key. Every layer's newest token ends at the same ``top - 1``, and the next token is
        ``top``. With no room to spare, this is the compact layout ``0..n-1``."""
        room = max(self.positions_held(), self.limit - max(q_len, self.limit // 4))
        layouts = [(layer, params, layer.offsets(room))
                   for layer, params in zip(self.layers, self.rotary) if layer.is_initialized]
        top = max((int(offsets.amax()) + 1 for _, _, offsets in layouts if offsets.numel()), default=0)
        for layer, params, offsets in layouts:
            layer.renumber(params, top - 1 - offsets)
        self.next_physical = top
        self.renumbers += 1

    def abort_forward(self) -> None:
        if self._rows is not None:
            return self._rows.abort_forward()
        self._chunk = None
        for layer in self.layers:
            layer.abort_forward()

    def end_forward(self, q_len: int) -> None:
        if self._rows is not None:
            return self._rows.end_forward(q_len)
        self._chunk = None
        for layer in self.layers:
            layer.end_forward()
        self.next_physical += q_len
        if self.progress is not None and q_len > 1:
            self.progress.update(q_len)
        if self._held == "holding":
            return
        compressing, self._held = self._held == "pending", None
        for layer_idx, layer in self.evicting_layers:
            if layer.is_initialized and layer.resident_count > self.budget:
                self._check_scored(layer)
                evicted = layer.evict(self.scoring, self.step, self.quotas, collect=self.spill is not None)
                if evicted is not None:
                    self.evicted(layer_idx, evicted)
        if compressing and self.bounded:  # the next query sees the compressed prompt within the limit
            self.renumber()

    @contextlib.contextmanager
    def holding(self):
        """Evict nothing while inside: the forwards prefill a prompt whole, and the first forward after
        the block (its question) compresses it to ``budget`` once, scored by that forward. This is
        SnapKV's own setting, where the observation window is the prompt's end and so its question;
        without it, every forward of a chunked prefill is compressed by its own end, before the question
        is seen. Memory grows with the prompt until the compressing forward, as DynamicCache's would, and
        positions run on from the last ones given (a bounded cache renumbers right after compressing)."""
        if self._held is not None or self.in_forward:
            raise RuntimeError("holding() cannot start inside a forward or another hold")
        for cache in dict.fromkeys([self, *self.rows]):
            cache._held = "holding"
        try:
            yield self
        finally:
            for cache in dict.fromkeys([self, *self.rows]):  # a batch's rows may have been built inside
                over = any(layer.is_initialized and layer.resident_count > self.budget
                           for _, layer in cache.evicting_layers)
                cache._held = "pending" if over else None

    def evicted(self, layer_idx: int, tokens: dict[str, torch.Tensor]) -> None:
        """Every token a layer evicts (flat, see ``EvictingLayer.tokens_at``): told to the memory, which
        spills it with a store and drops it without one."""
        self.memory.evicted(layer_idx, tokens)

    # -- tiers: restore, prefetch, save, resume ------------------------------------------------------
    @property
    def tier_stats(self) -> dict:
        """The store's counters (per tier: bytes, hits, misses, integrity failures, errors, seconds)
        and this cache's restores: count, tokens, seconds, and the stall (seconds a forward waited, and
        ``waited_fetches``: fetches not complete when their step came)."""
        return self.memory.stats()

    def restore(self, start: int, end: int) -> int:
        """Bring the evicted tokens of logical range ``[start, end)`` back now, and plan the range for
        the current step so that its foresight bonus keeps it. Returns the tokens restored (logical
        positions back in layer 0, in any KV head)."""
        self._one_sequence("restore(start, end)")
        return self.memory.restore(self, start, end)

    def fork(self) -> "EvictionCache":
        """An independent copy of this cache, bound to the same model and holding no store: a branch (a
        speculative probe, a sampled alternative) runs on the copy and this cache stays exactly as it was,
        so the session goes on as if the branch had never run. Why not ``copy.deepcopy``: the binding, the
        store and its threads must not be duplicated. Copied: every layer's tensors (resident and reference
        keys, ledger, scores), the policy with its blueprint, the step, the renumber state and the ids seen.
        The copy's evictions are dropped, never spilled into this session's store. ``unbind()`` it when done."""
        self._one_sequence("fork()")
        model = self._filled_by() if self._filled_by is not None else None
        if self.binding is None or model is None:
            raise RuntimeError("fork() needs a cache bound to a model (bind(model) first)")
        if self.in_forward or self._held is not None:
            raise RuntimeError("fork() cannot run inside a forward or while a held prompt is not yet compressed")
        twin = type(self).__new__(type(self))
        EvictionCache.__init__(twin, budget=self.budget, sinks=self.sinks, recent=self.recent,
                               scoring=copy.deepcopy(self.scoring), limit=self.limit)
        twin.layer_class = self.layer_class
        twin.bind(model)
        for mine, theirs in zip(twin.layers, self.layers):
            if theirs.is_initialized:
                mine.load(theirs.tensors(), theirs.get_seq_length())  # every kind's load copies
        twin._step, twin.renumbers, twin.next_physical = self._step, self.renumbers, self.next_physical
        twin.tokens = copy.deepcopy(self.tokens)
        return twin

    def save(self) -> str:
        """Write everything needed to continue this session to the store, as one new generation: every
        layer's tensors (resident and reference keys, ledger, scores), the step, the renumber state, the
        policy with its blueprint, and the spill index, tied together by a manifest of digests. All or
        nothing (``pace_hf.memory.persist``): it returns the generation once it is on every durable tier, or
        raises ``SaveFailed`` / ``WriterConflict`` and the previous save stays the one ``resume`` gives."""
        self._one_sequence("save()")
        if self._held is not None:
            raise RuntimeError("save() while a held prompt is not yet compressed (see holding()): run the "
                               "forward that compresses it first")
        return self.memory.save(self)

    @classmethod
    def resume(cls, session_id: str, *, store, model, scoring: ScoringPolicy | None = None) -> "EvictionCache":
        """Continue a session saved with :meth:`save`, possibly in another process, bound to ``model``.
        Every entry is checked against the save's manifest first: a session saved by another model,
        config or dtype, or with an entry missing or from another save, is refused, naming it, and so is one
        saved from another cache class. ``scoring`` replaces the saved policy with one of its kind."""
        return cls.memory_class.resume(cls, session_id, store=store, model=model, scoring=scoring)

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
        if m.get("layout", cache.layout) != cache.layout or len(m["layers"]) != len(cache.layers):
            cache.unbind()
            raise ValueError(f"session {session_id!r} was saved with the layers {_short(m.get('layout') or m['layers'])}; "
                             f"the model has {_short(cache.layout)}")
        for i, (tensors, meta) in states.items():
            cache.layers[i].load({k: v.to(model.device) for k, v in tensors.items()}, meta["seen"])
        cache.spill.load(m["spill"], m["generation"])
        cache._step, cache.renumbers, cache.next_physical = m["step"], m["renumbers"], m["next_physical"]
        cache.tokens = None  # a save keeps no ids: a resumed cache cannot check a prompt against them
        return cache

    def scores_layer(self, layer_idx: int) -> bool:
        """Only the layers that evict are scored: a sliding window never pays the score pass."""
        return self.layers[layer_idx].evicts

    def score_query_window(self, q_len: int) -> int | None:
        return self.scoring.query_window(q_len) if self.scoring.needs_attention else 0

    def record_attention(self, layer_idx: int, column_sums: torch.Tensor) -> None:
        self.layers[layer_idx].record_scores(column_sums[0], self.scoring)  # batch 1

    def _check_scored(self, layer) -> None:
        n = layer.resident_count
        if self.scoring.needs_attention and layer.scored != n:
            raise RuntimeError(
                "attention scores were not recorded for every token: the model must run its attention "
                f"through {attention.ATTN_NAME!r} (got {layer.scored} scores for {n} tokens)"
            )

    # -- retrieval: evicted context found by what a new turn asks (pace_hf.memory.retrieval) ----------------
    def retrieve(self, text: str, ids, tokenizer=None, *, retriever=None) -> list[Span]:
        """Rank the evicted pages of the context against the new turn ``text`` and restore the best
        ones, within ``quotas.retrieval_share`` tokens per KV head, exactly re-rotated and planned for the current
        step (see :mod:`pace_hf.memory.retrieval`). ``ids``: the ids of everything this cache has seen (the
        cache keeps no ids). The first call builds a ``PageRetriever(tokenizer)`` (or keeps
        ``retriever``); later calls reuse it. No store, or nothing spilled: a no-op."""
        self._one_sequence("retrieve(...)")
        return self.memory.retrieve(self, text, ids, tokenizer, retriever=retriever)

    def rehydrate(self, text: str, ids, tokenizer=None, *, retriever=None) -> list[Span]:
        """Deprecated name of :meth:`retrieve` (a planner's restore of named definitions is "rehydrate";
        finding evicted pages by what a turn says is "retrieve"); it goes in the next release."""
        import warnings

        warnings.warn("cache.rehydrate(...) is now cache.retrieve(...); the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return self.retrieve(text, ids, tokenizer, retriever=retriever)


class TokenLog:
    """The ids a cache has seen, in a buffer that grows geometrically (decode appends one per step).
    Positions past ``seen`` (a failed forward, a rewind) are overwritten by the next append."""

    def __init__(self):
        self._buffer = torch.empty(0, dtype=torch.int64)
        self.known = 0  # ids logged: the first ``known`` tokens the cache saw

    def append(self, seen: int, ids) -> "TokenLog | None":
        """Log ``ids`` after the first ``seen`` tokens; None (unknown from now on) when the log does not
        hold all ``seen`` (the layers were filled another way, e.g. loaded)."""
        if seen > self.known:
            return None
        ids = ids.reshape(-1).to("cpu", torch.int64)
        end = seen + ids.numel()
        if end > self._buffer.numel():
            grown = torch.empty(max(end, 2 * self._buffer.numel()), dtype=torch.int64)
            grown[:seen] = self._buffer[:seen]
            self._buffer = grown
        self._buffer[seen:end] = ids
        self.known = end
        return self

    def ids(self, seen: int) -> torch.Tensor:
        return self._buffer[:seen]


def _step(value) -> int:
    value = as_index(value, "cache.step")
    if value < 0:
        raise ValueError(f"cache.step must be >= 0, got {value}")
    return value


def _logical(positions) -> torch.Tensor:
    """Logical positions, flat, as ints: a float would be truncated to another position, and the reading
    would be of tokens the caller did not ask about."""
    positions = torch.as_tensor(positions)
    if positions.numel() and (positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool):
        raise TypeError(f"positions are ints (logical token positions), got {positions.dtype}")
    return positions.to(torch.long).flatten()


def _short(layout: list) -> str:
    """A layout for an error message: runs of one kind counted (``6 x sliding:512, full, ...``)."""
    runs: list[list] = []
    for kind in layout:
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    return ", ".join(f"{n} x {k}" if n > 1 else str(k) for k, n in runs)


__all__ = ["DEFAULT_RECENT", "DEFAULT_SINKS", "EvictionCache"]
