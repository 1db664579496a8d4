"""``SymbolPlanner``: a blueprint from the session's own text, with no oracle and no model.

Why: a hand-written blueprint is an oracle; a real agent has none. But an agent
does know its plan (the next steps' descriptions), and code sessions name things literally: a step
that says "write `settle(record)`" needs the message that defined ``settle``. So the planner matches
the identifiers each planned step mentions against the identifiers each earlier message defines
(``pace_hf.planner.extract``) and emits one span per defining message, read by every step that needs it.

Rules:

* Resolution: a name read at step ``s`` resolves to the *latest* message before step ``s`` (a message
  of an earlier step) that defines it. A later definition wins for later readers; an earlier reader
  still reads the earlier one.
* Closure (``depth``, default 1): a definition needs what it uses. The free names and attribute names
  of a resolved top-level definition resolve, as seen by its own message (the latest definition at or
  before that message), to more messages, up to ``depth`` hops. ``settle`` reads ``record.status``,
  so a step that names ``settle`` also reads the dataclass that defines ``status``. Forward references
  (a use of a name defined only later) are not followed; the step reaches them only by naming them.
  ``depth=0`` is pure literal matching.
* ``plan(session)`` keeps the cache's blueprint equal to ``blueprint_for(messages, steps)`` for the spans
  it added: it adds what is new and removes its own spans that a redefinition or a new step made stale
  (never spans that anyone else added, such as restores). A span equal to one the blueprint already
  holds is not added again (after ``PACESession.resume`` the saved blueprint holds the old plan; a fresh
  planner does not own those spans, so it will not remove them if they go stale).
* ``rehydrate(session, message)``: when a user turn arrives, the identifiers it names resolve the same
  way (against the messages before it); each defining message that is not fully resident is restored
  from the tiers before the turn is prefilled, read at the current step (a message not prefilled yet
  is planned for the current step instead, so the prefill that brings it in keeps it). Restores stop at
  ``max_restore_tokens`` (default: half the cache budget) so one turn cannot flush the cache;
  the most recent definitions go first.

Step numbers are those of ``PACESession``: its k-th user message is step k; a message of step k is read
by planned steps > k.
"""

from __future__ import annotations

import bisect
from typing import Iterable

from ..blueprint import Blueprint, Span, as_index
from .extract import read


class _Index:
    """Which messages define each name, in message order, per namespace."""

    def __init__(self, messages):
        self.messages = list(messages)
        self.top: dict[str, list[int]] = {}
        self.members: dict[str, list[int]] = {}
        self.any: dict[str, list[int]] = {}
        for i, m in enumerate(self.messages):
            sym = read(m.content)
            for name in sym.top:
                self.top.setdefault(name, []).append(i)
            for name in sym.members:
                self.members.setdefault(name, []).append(i)
            for name in sym.defined:
                self.any.setdefault(name, []).append(i)

    @staticmethod
    def latest(table: dict[str, list[int]], name: str, before: int) -> int | None:
        """The last message position < ``before`` that defines ``name`` in ``table``."""
        where = table.get(name)
        if not where:
            return None
        k = bisect.bisect_left(where, before)
        return where[k - 1] if k else None

    def resolve(self, names: Iterable[str], before: int, depth: int) -> set[int]:
        """Positions of the messages that ``names`` (read by something after ``before - 1``) need."""
        found: set[int] = set()
        frontier = []
        for name in names:
            i = self.latest(self.any, name, before)
            if i is not None:
                found.add(i)
                frontier.append((name, i))
        for _ in range(depth):
            nxt = []
            for name, i in frontier:
                sym = read(self.messages[i].content)
                deps = [(u, self.top) for u in sym.uses.get(name, ())] + \
                       [(a, self.members) for a in sym.attrs.get(name, ())]
                for dep, table in deps:
                    j = self.latest(table, dep, i + 1)  # as its own message saw it
                    if j is not None and j != i:
                        if j not in found:
                            found.add(j)
                        nxt.append((dep, j))
            frontier = nxt
        return found


class SymbolPlanner:
    """Blueprints from identifiers (see the module docstring).

    Args:
        steps: the agent's plan, ``{future step number: step description}``.
        depth: hops of the dependency closure (0: literal matches only).
        max_restore_tokens: the most tokens one ``rehydrate`` restores (default: half the cache budget).
    """

    def __init__(self, steps: dict[int, str] | None = None, *, depth: int = 1,
                 max_restore_tokens: int | None = None):
        self.steps: dict[int, str] = {}
        self.depth = as_index(depth, "depth")
        if self.depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self.max_restore_tokens = None if max_restore_tokens is None else as_index(max_restore_tokens,
                                                                                   "max_restore_tokens")
        self._blueprint: Blueprint | None = None
        self._added: dict[tuple, Span] = {}
        if steps:
            self.add_steps(steps)

    def add_steps(self, steps: dict[int, str]) -> None:
        """Add (or replace) planned steps: ``{step number: description}``."""
        if not isinstance(steps, dict):
            raise TypeError(f"steps must be a dict {{step number: description}}, got {type(steps).__name__}")
        for step, text in steps.items():
            step = as_index(step, "a planned step")
            if step < 0:
                raise ValueError(f"planned steps must be >= 0, got {step}")
            if not isinstance(text, str):
                raise TypeError(f"the description of step {step} must be a str, got {type(text).__name__}")
            self.steps[step] = text

    # -- readings -----------------------------------------------------------------------------------------
    def identifiers(self, text: str) -> set[str]:
        """Identifiers that ``text`` mentions."""
        return set(read(text).mentions)

    def definitions(self, text: str) -> set[str]:
        """Identifiers that ``text`` defines (top-level names, class members and named facts)."""
        return set(read(text).defined)

    # -- planning -----------------------------------------------------------------------------------------
    def blueprint_for(self, messages, steps: dict[int, str] | None = None) -> Blueprint:
        """The blueprint for ``messages`` (objects with ``content``, ``start``, ``end``, ``step``, in
        order) and the planned ``steps`` (default: this planner's): one span per defining message,
        read by every step that needs it."""
        steps = self.steps if steps is None else steps
        index = _Index(messages)
        msg_steps = [m.step for m in index.messages]
        readers: dict[int, set[int]] = {}
        for step, text in steps.items():
            before = bisect.bisect_left(msg_steps, step)  # messages of earlier steps
            for i in index.resolve(self.identifiers(text), before, self.depth):
                readers.setdefault(i, set()).add(step)
        return Blueprint(Span(index.messages[i].start, index.messages[i].end, sorted(readers[i]))
                         for i in sorted(readers))

    def plan(self, session) -> None:
        """Bring ``session.cache.blueprint`` up to date with the session's messages and the plan."""
        blueprint = session.cache.blueprint
        if blueprint is None:
            raise ValueError("SymbolPlanner needs a cache with a Foresight policy (PACECache)")
        if blueprint is not self._blueprint:
            self._blueprint, self._added = blueprint, {}
        want = {(s.start, s.end, s.readers): s for s in self.blueprint_for(session.messages)}
        for key in [k for k in self._added if k not in want]:  # stale: redefined, or readers changed
            blueprint.remove(self._added.pop(key))
        held = {(s.start, s.end, s.readers) for s in blueprint}
        for key, span in want.items():
            if key not in self._added and key not in held:  # held: e.g. saved before a resume
                self._added[key] = blueprint.add(span)

    # -- rehydration --------------------------------------------------------------------------------------
    def rehydrate(self, session, message) -> list[Span]:
        """Bring back the messages that define what the new turn ``message`` names (see the module
        docstring): the evicted part of one already prefilled is restored from the tiers; a part still
        to be prefilled (messages added since the last forward) is planned for the current step, so that
        prefill keeps it. Returns the spans planned for this step, most recent first."""
        messages = session.messages
        before = next((i for i, m in enumerate(messages) if m is message), None)
        if before is None:
            before = next((i for i, m in enumerate(messages) if m.index >= message.index), len(messages))
        index = _Index(messages[:before])
        needed = index.resolve(self.identifiers(message.content), before, self.depth)
        cache = session.cache
        seen = cache.get_seq_length()
        cache.step = session.step
        cap = self.max_restore_tokens if self.max_restore_tokens is not None else cache.budget // 2
        planned, used = [], 0
        for i in sorted(needed, reverse=True):
            m = messages[i]
            end = min(m.end, seen)  # [m.start, end) is prefilled, [end, m.end) is not yet
            evicted = m.start < end and cache.residency(range(m.start, end)) < 1.0
            pending = m.end > end
            if not (evicted or pending) or used + (m.end - m.start) > cap:
                continue
            if evicted:
                cache.restore(m.start, end)  # plans [m.start, end) for this step
            if pending:
                cache.blueprint.add(Span(end if evicted else m.start, m.end, [cache.step]))
            used += m.end - m.start
            planned.append(Span(m.start, m.end, [cache.step]))
        return planned
