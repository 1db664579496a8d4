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

A function (or a method) too large for its step is planned, while it fits, as (why: what a change to
it reads first is its interface, then the lines about what the step is about, then what it gives back):

1. for a method, its class's header;
2. its signature (decorators and ``def`` lines) and its docstring's first line;
3. the statement lines that use a name or word the step mentions (a compound statement by its header:
   the condition, not the block);
4. its ``return`` statements;
5. then its other statement lines in source order, up to the room.

A piece that does not fit is skipped, and smaller later pieces still go in; but a definition whose
header (a class's) or signature (a function's) does not fit gets nothing: its lines alone are no use.
A definition with no outline (an assignment) is planned from its start up to the room.
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
           context: bool = False, words: set[str] = frozenset()):
    """Token spans of ``definition``'s digest within ``room`` tokens. ``named``: the member names the
    step names; ``relevance``: BM25 score of each member for the step; ``tokens(parts)``: character
    ranges of the message to absolute token spans; ``context``: only parts 1-3, the context of the
    named members (for a class named as their owner); ``words``: the step's other words (a function's
    lines that use one of them, or a name, come first)."""
    outline = definition.outline
    if outline is None:
        return _head(tokens(definition.parts), room)
    if definition.kind != "class":
        return _function(definition, set(named) | set(words), room, tokens, context)
    members = outline.members
    score = {m.name: relevance.get(m.name, 0.0) for m in members}
    chosen = [m for m in members if m.name in named]
    used = set().union(*(m.uses for m in chosen)) if chosen else set()
    by_relevance = sorted(members, key=lambda m: -score[m.name])  # stable: source order among equals
    best = max(score.values(), default=0.0)
    relevant = [m for m in by_relevance if best > 0 and score[m.name] >= RELEVANT * best]
    if not _fill([(outline.header,)], room, tokens):
        return []  # members without their class are no use
    pieces = [(outline.header,)]
    pieces += [(m.whole,) for m in chosen]
    pieces += [(m.signature,) for m in members if m.name in used]
    if not context:
        pieces += [(m.signature,) + ((m.doc,) if m.doc else ()) for m in relevant]
        pieces += [(m.whole,) for m in relevant]
        pieces += [(m.signature,) + ((m.doc,) if m.doc else ()) for m in by_relevance]
    return _fill(pieces, room, tokens)


def _function(definition: Definition, mentioned: set[str], room: int, tokens, context: bool = False):
    """A function's digest (see the module docstring): nothing when not even its signature fits (lines
    without it are no use), and its other lines in order only while they fit (no scattered lines);
    ``context``: its signature and docstring line only."""
    outline = definition.outline
    head = (definition.parts[0],) if len(definition.parts) > 1 else ()  # a method's class header
    head += (outline.header,)
    out = _fill([head + (outline.doc,)] if outline.doc else [], room, tokens) or _fill([head], room, tokens)
    if not out or context:
        return out
    out = _fill([(line.chars,) for line in outline.lines if line.names & mentioned]
                + [(line.chars,) for line in outline.lines if line.returns], room, tokens, out)
    for line in outline.lines:
        spans = tokens((line.chars,))
        if union_size(out + spans) > room:
            break
        out += spans
    return out


def _fill(pieces, room: int, tokens, out=()) -> list[tuple[int, int]]:
    """``out`` and the pieces' token spans, in order, each while the union stays within ``room`` (a piece
    that does not fit is skipped; a later, smaller one may still go in)."""
    out = list(out)
    for parts in dict.fromkeys(pieces):  # a line both named and returning is tried once
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
