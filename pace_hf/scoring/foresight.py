"""PACE's foresight: planned spans get a bonus on top of any scoring policy's priority.

``Foresight(CumulativeAttention(), blueprint)`` is PACE's retention half; wrapped around SnapKV or
StreamingLLM it gives their foresight variants for free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..blueprint import Blueprint
from .base import ScoringPolicy
from .cumulative import CumulativeAttention


@dataclass(frozen=True)
class ForesightBonus:
    """``bonus = phi * (1 + 1 / (s_n - t + 1)) / 2`` for a span whose next reader is s_n at step t.

    It is phi when the reader is the current step and falls toward the floor phi/2 as the reader gets
    farther away. The floor (5e4 by default) is above the largest unplanned cumulative-attention score
    the paper observed (2.5e4 at 2M tokens), so planned spans outrank everything else and the soonest
    needed span ranks first. Any callable ``(next_reader, step) -> float`` can replace it.
    """

    phi: float = 1e5

    def __post_init__(self):
        if not (isinstance(self.phi, (int, float)) and self.phi > 0):
            raise ValueError(f"phi must be a positive number, got {self.phi!r}")

    def __call__(self, next_reader: int, step: int) -> float:
        if next_reader < step:
            raise ValueError(f"the next reader {next_reader} is behind the current step {step}")
        return self.phi * (1.0 + 1.0 / (next_reader - step + 1)) / 2.0


@dataclass(frozen=True)
class Foresight(ScoringPolicy):
    """``inner``'s priority plus ``bonus(next_reader, step)`` for the tokens of planned spans."""

    inner: ScoringPolicy = field(default_factory=CumulativeAttention)
    blueprint: Blueprint = field(default_factory=Blueprint)
    bonus: Callable[[int, int], float] = field(default_factory=ForesightBonus)

    def __post_init__(self):
        if not isinstance(self.inner, ScoringPolicy):
            raise TypeError(f"Foresight wraps a ScoringPolicy, got {type(self.inner).__name__}")
        if not isinstance(self.blueprint, Blueprint):
            raise TypeError(f"blueprint must be a pace_hf.Blueprint, got {type(self.blueprint).__name__}")
        if not callable(self.bonus):
            raise TypeError("bonus must be a callable (next_reader, step) -> float")

    @property
    def needs_attention(self) -> bool:  # passed through, as kvpress's wrappers pass compression_ratio
        return self.inner.needs_attention

    def query_window(self, q_len: int) -> int | None:
        return self.inner.query_window(q_len)

    def accumulate(self, scores: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        return self.inner.accumulate(scores, fresh)

    def priority(self, logical: torch.Tensor, scores: torch.Tensor, step: int) -> torch.Tensor:
        return self.inner.priority(logical, scores, step) + self.blueprint.bonus(logical, step, self.bonus)
