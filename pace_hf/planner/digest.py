"""A digest of a definition too large to plan whole: the part of it a step most likely reads.

Why: a step that names a 3K-token class cannot have it planned whole under a 1K cap, and dropping it
plans nothing of it. But a step on a class reads its header, what its members are called and take,
and the bodies of the members it names, not every line. So a class over the room left in its step's
plan is planned as its digest, built in this order while it fits (a class named as the owner of
members the step names, "subclass `Retry` and override `sleep`", is planned as the first three only:
their context):

1. the class's header (decorators and ``class`` line);
2. the whole source of the members the step names;
3. the signatures of the members those use on ``self``;
4. the signatures and docstring first lines of the members most relevant to the step (BM25 over the
   session's definitions, ``pace_hf.planner.prose``: at least half the best member's score), then
   their whole source, best first;
5. then the signatures and docstring first lines of the other members, up to the room.

A piece that does not fit is skipped, and smaller later pieces still go in. A definition with no
outline (a function, an assignment) is planned from its start (signature, docstring, first lines) up
to the room.
"""

from __future__ import annotations

from .extract import Definition


RELEVANT = 0.5  # a member is relevant to a step when it scores at least this share of the best member


def union_size(spans) -> int:
    """Tokens in the union of ``(start, end)`` spans."""
    total, end = 0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total, end = total + e - s, e
        elif e > end:
            total, end = total + e - end, e
    return total


def digest(definition: Definition, named: set[str], relevance: dict[str, float], room: int, tokens,
           context: bool = False):
    """Token spans of ``definition``'s digest within ``room`` tokens. ``named``: the member names the
    step names; ``relevance``: BM25 score of each member for the step; ``tokens(parts)``: character
    ranges of the message to absolute token spans; ``context``: only parts 1-3, the context of the
    named members (for a class named as their owner)."""
    if definition.outline is None:
        return _head(tokens(definition.parts), room)
    outline = definition.outline
    members = outline.members
    score = {m.name: relevance.get(m.name, 0.0) for m in members}
    chosen = [m for m in members if m.name in named]
    used = set().union(*(m.uses for m in chosen)) if chosen else set()
    by_relevance = sorted(members, key=lambda m: -score[m.name])  # stable: source order among equals
    best = max(score.values(), default=0.0)
    relevant = [m for m in by_relevance if best > 0 and score[m.name] >= RELEVANT * best]
    pieces = [(outline.header,)]
    pieces += [(m.whole,) for m in chosen]
    pieces += [(m.signature,) for m in members if m.name in used]
    if not context:
        pieces += [(m.signature,) + ((m.doc,) if m.doc else ()) for m in relevant]
        pieces += [(m.whole,) for m in relevant]
        pieces += [(m.signature,) + ((m.doc,) if m.doc else ()) for m in by_relevance]
    out: list[tuple[int, int]] = []
    for parts in pieces:
        spans = tokens(parts)
        if spans and union_size(out + spans) <= room:
            out += spans
    return out


def _head(spans, room: int) -> list[tuple[int, int]]:
    """The first ``room`` tokens of ``spans``."""
    out = []
    for s, e in sorted(spans):
        if room <= 0:
            break
        out.append((s, min(e, s + room)))
        room -= out[-1][1] - s
    return out
