"""The planner's blueprint: which earlier spans later steps will read, and the foresight bonus.

A span ``[start, end)`` in logical token positions is read by the agent steps in ``readers``. While a
reader is still ahead, the span's tokens get a bonus on top of their attention score so they survive
eviction; after the last reader the bonus is 0 and the span competes like any other tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch


@dataclass(frozen=True)
class Span:
    """Logical token range ``[start, end)`` read by the agent steps ``readers``."""

    start: int
    end: int
    readers: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        object.__setattr__(self, "readers", tuple(sorted(int(r) for r in self.readers)))
        if not (isinstance(self.start, int) and isinstance(self.end, int)):
            raise TypeError(f"span bounds must be ints, got start={self.start!r} end={self.end!r}")
        if self.start < 0 or self.end < 0:
            raise ValueError(f"span bounds must be >= 0, got [{self.start}, {self.end})")
        if self.end <= self.start:
            raise ValueError(f"span end must be > start, got [{self.start}, {self.end})")
        if any(r < 0 for r in self.readers):
            raise ValueError(f"reader steps must be >= 0, got {list(self.readers)}")

    def next_reader(self, step: int) -> int | None:
        """The first reader at or after ``step``, or None once every reader is past."""
        return next((r for r in self.readers if r >= step), None)


class BonusFn(Protocol):
    def __call__(self, next_reader: int, step: int) -> float: ...


@dataclass(frozen=True)
class ForesightBonus:
    """``bonus = phi * (1 + 1 / (s_n - t + 1)) / 2`` for a span whose next reader is s_n at step t.

    It is phi when the reader is the current step and falls toward the floor phi/2 as the reader gets
    farther away. The floor (5e4 by default) is above the largest unplanned cumulative-attention score
    the paper observed (2.5e4 at 2M tokens), so planned spans outrank everything else and the soonest
    needed span ranks first. Any callable ``(next_reader, step) -> float`` can replace it.
    """

    phi: float = 1e5

    def __call__(self, next_reader: int, step: int) -> float:
        return self.phi * (1.0 + 1.0 / (next_reader - step + 1)) / 2.0


class Blueprint:
    """A list of spans with their reader steps, as a planner emits it."""

    def __init__(self, spans: Iterable[Span] = ()):
        spans = list(spans)
        for span in spans:
            if not isinstance(span, Span):
                raise TypeError(f"a Blueprint holds Span objects, got {type(span).__name__}")
        self.spans = spans

    @classmethod
    def from_dicts(cls, rows: Iterable[dict]) -> "Blueprint":
        """Build from ``[{"start", "end", "readers"}]`` records (e.g. a dataset column)."""
        return cls(Span(int(r["start"]), int(r["end"]), tuple(r.get("readers", ()))) for r in rows)

    def __len__(self) -> int:
        return len(self.spans)

    def __repr__(self) -> str:
        return f"Blueprint({self.spans!r})"

    def bonus(self, logical: torch.Tensor, step: int, bonus_fn: BonusFn) -> torch.Tensor:
        """The foresight bonus of every token at the ``logical`` positions (fp32, same shape).

        Where spans overlap, the largest bonus wins.
        """
        out = torch.zeros(logical.shape, dtype=torch.float32, device=logical.device)
        for span in self.spans:
            reader = span.next_reader(step)
            if reader is None:
                continue
            inside = (logical >= span.start) & (logical < span.end)
            out = torch.where(inside, out.clamp_min(float(bonus_fn(reader, step))), out)
        return out
