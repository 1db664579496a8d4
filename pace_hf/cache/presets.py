"""The named caches: each is ``EvictionCache`` with one policy (and, for PACE, bounded positions)."""

from __future__ import annotations

import dataclasses

from ..blueprint import Blueprint
from ..scoring import CumulativeAttention, Foresight, ForesightBonus, ObservationWindow, Recency, ScoringPolicy
from .eviction import EvictionCache
from .quotas import DEFAULT_SINKS


class H2OCache(EvictionCache):
    """Heavy-hitter oracle: keep the tokens with the most cumulative attention (plus sinks and recent).
    With ``limit`` it is the positions-only arm."""

    def __init__(self, model=None, *, budget: int = 2048, **kwargs):
        kwargs.setdefault("scoring", CumulativeAttention())
        super().__init__(model, budget=budget, **kwargs)


class PACECache(EvictionCache):
    """PACE: foresight (a bonus for the blueprint's planned spans) around H2O, with bounded positions.

    ``PACECache(model, blueprint, budget=..., limit=...)``: the model first, as every other cache takes
    it. The old order, ``PACECache(blueprint, model)`` (or ``PACECache(blueprint, model=model)``), still
    works for this release and warns (``DeprecationWarning``); it goes in the next.

    Args:
        model: the model to bind to (or call ``bind(model)`` later).
        blueprint: the planned spans and the steps that read them (``Blueprint()``: none yet); for a batch,
            one shared by every row, or a list of one per row.
        budget: resident tokens kept per full-attention layer and KV head after each forward.
        limit: every rotary position stays below it (at least ``budget`` plus the largest chunk). The
            default, ``"auto"``, is the model's trained positions (its ``max_position_embeddings``, capped
            by a switching RoPE's switch length), read at bind: inside them a bounded distance costs
            the model context it could read, past them it keeps every distance one the model has seen.
            ``limit=None`` is the retention-only arm.
        phi: the foresight bonus's scale (``ForesightBonus(phi)``); ``bonus`` replaces it whole.
        scorer: the policy under the bonus (default H2O; ``ObservationWindow()`` for SnapKV with foresight).
        **kwargs: the rest of ``EvictionCache``'s settings: ``sinks``, ``recent`` (128 by default, so a
            budget under 132 needs a smaller ``recent``), ``store``, ``session_id``, ``prefetch_steps``,
            ``spill_tokens``, ``spill_cap_bytes``.

    Set ``cache.step`` to the agent's current step. ``get_seq_length()`` is the number of tokens seen
    (what ``generate`` slices new input by), not the number resident: ``resident_count()`` and
    ``ledger(layer)`` say what is held.
    """

    def __init__(
        self,
        *args,
        model=None,
        blueprint: Blueprint | None = None,
        budget: int = 2048,
        limit: int | str | None = "auto",
        phi: float = 1e5,
        bonus=None,
        scorer: ScoringPolicy | None = None,
        **kwargs,
    ):
        model, blueprint = _model_and_blueprint(args, model, blueprint)
        blueprint = Blueprint() if blueprint is None else blueprint
        per_row = None
        if isinstance(blueprint, (list, tuple)):  # one per row of a batch
            per_row = list(blueprint)
            if not per_row or not all(isinstance(b, Blueprint) for b in per_row):
                raise TypeError("blueprint must be a pace_hf.Blueprint, or a non-empty list of them (one per batch row)")
            blueprint = per_row[0]
        if not isinstance(blueprint, Blueprint):
            raise TypeError(f"blueprint must be a pace_hf.Blueprint, got {type(blueprint).__name__}")
        if "scoring" in kwargs:
            raise TypeError("PACECache builds its scoring from blueprint, scorer and bonus; use EvictionCache(scoring=...)")
        foresight = Foresight(scorer or CumulativeAttention(), blueprint, bonus if bonus is not None else ForesightBonus(phi))
        self._row_blueprints = per_row
        super().__init__(model, budget=budget, limit=limit, scoring=foresight, **kwargs)

    _row_blueprints = None  # a list: one blueprint per batch row (a resumed or row cache has none)

    def _rows_expected(self) -> int | None:
        expected = super()._rows_expected()
        if self._row_blueprints is not None:
            if expected is not None and expected != len(self._row_blueprints):
                raise ValueError(f"{len(self._row_blueprints)} blueprints but {expected} steps: give one of each per row")
            return len(self._row_blueprints)
        return expected

    def _row_scoring(self, r: int):
        if self._row_blueprints is None:
            return self.scoring
        return dataclasses.replace(self.scoring, blueprint=self._row_blueprints[r])

    @property
    def bonus(self):
        return self.scoring.bonus


def _model_and_blueprint(args: tuple, model, blueprint):
    """``(model, blueprint)`` from ``PACECache``'s positional arguments: ``(model, blueprint)``, or the
    deprecated ``(blueprint, model)``, told apart by the blueprint's type (a ``None`` first with a model
    second is the old order's "no plan yet")."""
    if len(args) > 2:
        raise TypeError(f"PACECache takes at most 2 positional arguments (model, blueprint), got {len(args)}")
    if not args:
        return model, blueprint
    first, second = args[0], (args[1] if len(args) == 2 else None)
    old = isinstance(first, Blueprint) or (first is None and len(args) == 2 and not isinstance(second, Blueprint))
    given_model, given_blueprint = (second, first) if old else (first, second)
    if model is not None and (len(args) == 2 or not old):
        raise TypeError("PACECache got the model twice (positionally and as model=)")
    if blueprint is not None and (len(args) == 2 or old):
        raise TypeError("PACECache got the blueprint twice (positionally and as blueprint=)")
    if old:
        import warnings

        # the warning names the call that was made: PACECache(blueprint) is the old order without a model
        made = "blueprint" + (", model" if len(args) == 2 else ", model=model" if model is not None else "")
        warnings.warn(f"PACECache({made}) is deprecated: the model comes first, as for every other cache "
                      "(PACECache(model, blueprint), or blueprint=...); the old order goes in the next release",
                      DeprecationWarning, stacklevel=3)
    return (given_model if len(args) == 2 or not old else model), (given_blueprint if len(args) == 2 or old else blueprint)


class SnapKVCache(EvictionCache):
    """SnapKV: scores from the observation window of each forward's last queries, max-pooled."""

    def __init__(self, model=None, *, budget: int = 2048, window: int = 32, kernel: int = 7, **kwargs):
        super().__init__(model, budget=budget, scoring=ObservationWindow(window, kernel), **kwargs)


class StreamingLLMCache(EvictionCache):
    """StreamingLLM: attention sinks plus the most recent tokens."""

    def __init__(self, model=None, *, budget: int = 2048, sinks: int = DEFAULT_SINKS, **kwargs):
        kwargs.setdefault("recent", 0)
        super().__init__(model, budget=budget, sinks=sinks, scoring=Recency(), **kwargs)


__all__ = ["H2OCache", "PACECache", "SnapKVCache", "StreamingLLMCache"]
