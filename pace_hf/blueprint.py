"""The planner's blueprint: which earlier spans later steps will read.

A span ``[start, end)`` in logical token positions is read by the agent steps in ``readers``. While a
reader is still ahead, the span's tokens get a foresight bonus (``pace_hf.scoring.Foresight``) on top
of their attention score so they survive eviction; after the last reader the bonus is 0 and the span
competes like any other tokens.

Spans can be written in token positions, or derived from character offsets of a text
(:meth:`Blueprint.from_char_spans`) or from chat messages (``pace_hf.chat``, ``PACESession.plan``).
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .chat import TokenOffsets


def as_index(value, what: str) -> int:
    """``value`` as an int, refusing floats, strings and bools (which ``int()`` would silently bend)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


def as_steps(readers, what: str = "readers") -> tuple[int, ...]:
    """A list of reader steps: ints >= 0. A bare int or a string is refused, not reinterpreted."""
    if isinstance(readers, (str, bytes)) or not isinstance(readers, Iterable):
        raise TypeError(f"{what} must be a list of step numbers (ints), e.g. [5, 9]; got {readers!r}")
    steps = tuple(sorted(as_index(r, f"a reader step in {what}") for r in readers))
    if any(r < 0 for r in steps):
        raise ValueError(f"reader steps must be >= 0, got {list(steps)}")
    return steps


@dataclass(frozen=True)
class Span:
    """Logical token range ``[start, end)`` read by the agent steps ``readers``."""

    start: int
    end: int
    readers: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        object.__setattr__(self, "start", as_index(self.start, "span start"))
        object.__setattr__(self, "end", as_index(self.end, "span end"))
        object.__setattr__(self, "readers", as_steps(self.readers))
        if self.start < 0 or self.end < 0:
            raise ValueError(f"span bounds must be >= 0, got [{self.start}, {self.end})")
        if self.end <= self.start:
            raise ValueError(f"span end must be > start, got [{self.start}, {self.end})")

    def next_reader(self, step: int) -> int | None:
        """The first reader at or after ``step``, or None once every reader is past."""
        return next((r for r in self.readers if r >= step), None)

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "readers": list(self.readers)}


class Blueprint:
    """A list of spans with their reader steps, as a planner emits it. Spans can be added later
    (an agent learns of new dependencies as it goes); a cache holding the blueprint sees them."""

    def __init__(self, spans: Iterable[Span] = ()):
        if isinstance(spans, Span) or not isinstance(spans, Iterable):
            raise TypeError(f"Blueprint takes a list of Span objects, e.g. Blueprint([Span(0, 350, [5, 9])]); "
                            f"got {type(spans).__name__}")
        self.spans: list[Span] = []
        self._warned: set[tuple[str, int, int]] = set()  # (what, start, end): each warning once per span
        self._table = None  # the bonus table of the last step (see _bonus_table)
        for span in spans:
            self.add(span)

    def add(self, span: Span) -> Span:
        if not isinstance(span, Span):
            raise TypeError(f"a Blueprint holds Span objects, got {type(span).__name__}")
        self.spans.append(span)
        return span

    def remove(self, span: Span) -> None:
        """Remove ``span`` (this very object: equal spans added by someone else stay)."""
        for i, held in enumerate(self.spans):
            if held is span:
                del self.spans[i]
                return
        raise ValueError(f"{span!r} is not in this blueprint")

    @classmethod
    def from_dicts(cls, rows: Iterable[dict]) -> "Blueprint":
        """Build from ``[{"start", "end", "readers"}]`` records (e.g. a dataset column)."""
        spans = []
        for row in rows:
            if not isinstance(row, dict) or not {"start", "end"} <= set(row):
                raise ValueError(f"a blueprint record needs 'start' and 'end' (and 'readers'), got {row!r}")
            spans.append(Span(row["start"], row["end"], row.get("readers", ())))
        return cls(spans)

    @classmethod
    def from_char_spans(cls, tokenizer, text: str, spans: Iterable[tuple[int, int, Iterable[int]]],
                        offset: int = 0) -> "Blueprint":
        """Spans given as character ranges ``(start_char, end_char, readers)`` of ``text``.

        ``text`` is tokenized as the model will see it (no special tokens added); each range covers
        every token that overlaps it. ``offset`` is the logical position of the text's first token
        (the number of tokens before it in the session)."""
        offsets, _ = TokenOffsets.of(tokenizer, text)
        out = []
        for start_char, end_char, readers in spans:
            start_char, end_char = as_index(start_char, "start_char"), as_index(end_char, "end_char")
            if not 0 <= start_char < end_char <= len(text):
                raise ValueError(f"character range [{start_char}, {end_char}) is not inside the text "
                                 f"of {len(text)} characters")
            tokens = offsets.span(start_char, end_char)
            if tokens is None:
                raise ValueError(f"character range [{start_char}, {end_char}) covers no token")
            out.append(Span(offset + tokens[0], offset + tokens[1], readers))
        return cls(out)

    def to_dicts(self) -> list[dict]:
        return [s.to_dict() for s in self.spans]

    def __len__(self) -> int:
        return len(self.spans)

    def __iter__(self):
        return iter(self.spans)

    def __repr__(self) -> str:
        return f"Blueprint({self.spans!r})"

    def past(self, length: int) -> list[Span]:
        """Spans that reach past the first ``length`` tokens."""
        return [span for span in self.spans if span.end > length]

    def warn_past(self, length: int) -> None:
        """Warn (once per span) about spans that reach past a prompt of ``length`` tokens: every token
        generated or added after the prompt, up to the span's end, would get the bonus. The cache calls
        this when decoding starts, where the blueprint meets the prompt."""
        for span in self.past(length):
            if ("past", span.start, span.end) not in self._warned:
                self._warned.add(("past", span.start, span.end))
                warnings.warn(f"blueprint span [{span.start}, {span.end}) reaches past the end of the prompt "
                              f"({length} tokens): the tokens that come after the prompt get its bonus; end "
                              f"the span at the prompt's end, or plan new tokens once they exist",
                              UserWarning, stacklevel=2)

    def warn_larger(self, budget: int) -> None:
        """Warn (once per span) about spans longer than the cache's ``budget``: no eviction can keep them
        whole, so only their best-scored tokens stay, and they push other planned spans out. The cache
        calls this before each prefill chunk, so spans planned later are checked too."""
        for span in self.spans:
            if span.end - span.start > budget and ("larger", span.start, span.end) not in self._warned:
                self._warned.add(("larger", span.start, span.end))
                warnings.warn(f"blueprint span [{span.start}, {span.end}) holds {span.end - span.start} tokens, more "
                              f"than the cache's budget of {budget}: only part of it can stay resident, and it pushes "
                              "out other planned spans; plan only what its readers need, or raise the budget",
                              UserWarning, stacklevel=2)

    def due(self, step: int, within: int) -> list[Span]:
        """Spans whose next reader is in ``[step, step + within]``."""
        out = []
        for span in self.spans:
            reader = span.next_reader(step)
            if reader is not None and reader - step <= within:
                out.append(span)
        return out

    def bonus(self, logical: torch.Tensor, step: int, bonus_fn) -> torch.Tensor:
        """The foresight bonus of every token at the ``logical`` positions (fp32, same shape).

        Where spans overlap, the largest bonus wins. The bonus is constant between consecutive span
        edges, so it is one table per step (built once, shared by every layer and head) and one
        ``searchsorted`` per call, not a pass over the tokens per span."""
        edges, table = self._bonus_table(step, bonus_fn, logical.device)
        if edges is None:
            return torch.zeros(logical.shape, dtype=torch.float32, device=logical.device)
        # the cache passes a view of its slot buffer; searchsorted copies such a view anyway, and warns
        return table[torch.searchsorted(edges, logical.contiguous(), right=True)]

    def _bonus_table(self, step: int, bonus_fn, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(edges, table)``: the sorted span edges, and the bonus of each segment, where segment ``i``
        is ``[edges[i-1], edges[i])`` and segments 0 and ``len(edges)`` lie outside every span. Cached
        until the step, the bonus function or the spans change (spans are frozen: same objects, same
        values)."""
        cached = self._table
        if (cached is not None and cached[0] == step and cached[1] == bonus_fn and cached[2] == device
                and len(cached[3]) == len(self.spans) and all(a is b for a, b in zip(cached[3], self.spans))):
            return cached[4], cached[5]
        live = [(span.start, span.end, float(bonus_fn(reader, step))) for span in self.spans
                if (reader := span.next_reader(step)) is not None]
        edges, table = None, None
        if live:
            points = sorted({p for start, end, _ in live for p in (start, end)})
            at = {p: i for i, p in enumerate(points)}
            values = [0.0] * (len(points) + 1)
            for start, end, value in live:
                for i in range(at[start] + 1, at[end] + 1):
                    values[i] = max(values[i], value)
            edges = torch.tensor(points, dtype=torch.long, device=device)
            table = torch.tensor(values, dtype=torch.float32, device=device)
        self._table = (step, bonus_fn, device, list(self.spans), edges, table)
        return edges, table
