"""``SymbolPlanner``: a blueprint from the session's own text, with no oracle and no model.

Why: a hand-written blueprint is an oracle; a real agent has none. But an agent does know its plan
(the next steps' descriptions), and code sessions name what they need. So the planner resolves what
each planned step names against the definitions of earlier messages (``pace_hf.planner.extract``)
and plans the token span of each needed *definition* (not its message: a step needs a 150-token
function, not the 10K-token file around it), read by every step that needs it.

Resolution (``_Index``), as seen by a step: only messages of earlier steps count, and the latest
definition wins.

* Two namespaces: top-level names, and members keyed by class. A bare name is the top-level one; a
  prose fact only when no code defines the name (a remark is a mention, not a definition); a member
  (a method named without its class) only when no top-level name exists. A name written after a dot
  alone (`` `.put()` ``) is a method: the only class's that defines it, else that of the step's own
  class or of the class the surrounding steps are about (nearest first), else the latest.
* ``C.m`` is member ``m`` of ``C``, looked up through the bases the session defines, in MRO order, each
  base the class of the file its import names (``from .base import Base as B``; ``import textwrap``
  then ``textwrap.TextWrapper``, a base of the same name as the subclass), never the class itself. A
  step that names a class and, apart, a member of it ("subclass `C` and override `m`", "the m method of
  the c class") means ``C.m`` the same way, and needs ``C`` only as the member's context (its header,
  the member's body and the signatures it uses on ``self``); ``C.m`` inherited from a base also plans
  ``C``'s header.
  ``mod.f`` is ``f`` of the file whose path ends with ``mod``, through the session's import aliases
  (``import a.b as c``; ``from pkg import mod``).
* A name the session defines is an identifier even if it is a builtin or an English word, when the
  step writes it as code. Prose words go through ``pace_hf.planner.prose``: joins, camel/snake
  spellings, a word before "function"/"class"/..., the head word of one name of that kind ("the
  wrapper class": ``TextWrapper``) and, in a step that does not describe (below), adjacent words that
  are the words of exactly one name in any order and inflection ("chunk splitting": ``_split_chunks``;
  in a description's many words such a match is mostly a coincidence); a step that resolves nothing at
  all is ranked
  lexically (BM25 over names, signatures and docstrings) and gets its best match. A step that names
  definitions but also describes one (four content words or more: "the inverse of `split`: it returns
  a shell-escaped string ...") also gets its best lexical match, if that match scores over twice every
  definition it named. On agent-like sessions over real source files (the README's planner table) this
  took steps that are a docstring's first sentence from recall 0.73 to 0.86; literal plans of long
  sentences kept their precision (0.955 against 0.954).
* A plain word that is exactly a name the session defines ("after decodebytes runs") is that name when
  it is no English word (the session's own prose says which words are), and an English one when the
  sentence's grammar makes it a thing and nothing else in the step is a candidate; descriptions and
  steps that also name code ask for more (``pace_hf.planner.prose``, "Bare names").
* Closure (``depth``, default 1): a needed function also needs the class of a field it uses on a
  parameter, when only one class declares that field in its body (``record.status`` of a dataclass), as
  its own message saw it. Nothing else is followed (free names, constants, any attribute name): in
  sessions over real source files they added tokens and false edges, and nowhere recall.

Spans: each definition's character ranges map to tokens through the chat template's offsets
(``pace_hf.chat.ChatTemplate.content_offsets``); spans with the same readers that touch are merged.
Without a template (``blueprint_for(messages)`` alone) each definition plans its whole message.

Budget: each step's plan is kept under ``share * budget`` tokens (default half the cache budget), and
the live plan (every span with a reader after the current step) under ``budget``, since the cache
cannot hold more. Needs are ranked by their soonest reader, then by how literally the step named them,
then by size. A need that does not fit whole waits until every need that fits whole is planned; then
each gets its digest (``pace_hf.planner.digest``: of a class its header, the members the step names,
signatures, the most relevant members; of a function its signature, docstring line, the lines with the
step's names, its returns) in a fair share of the room left, in its step and in the live plan (what one
leaves goes to the next), so that a step with several large needs plans a part of each; it is listed
on ``Plan.partial``. One that the step does not name in code (or names in words in a description)
gets only its head (header or signature). A need with no room left (or whose head does not fit) is
dropped and listed on ``Plan.dropped``. A later ``plan()`` (after the early readers pass) brings it back.

``plan(session)`` keeps the cache's blueprint equal to ``blueprint_for(...)`` for the spans it added:
it adds what is new and removes its own spans that went stale (never spans someone else added, such
as restores; a span equal to one the blueprint already holds is not added twice).

``rehydrate(session, message)``: when a user turn arrives, the definitions it names (resolved the same
way, against the messages before it, but never by lexical ranking: a turn is not a plan) that are not
fully resident are restored from the tiers before the turn is prefilled, read at the current step; a
part not prefilled yet is planned for the current step.
Restores stop at ``max_restore_tokens`` (default: half the cache budget); the most recent go first.

Step numbers are those of ``PACESession``: its k-th user message is step k; a message of step k is read
by planned steps > k.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..blueprint import Blueprint, Span, as_index
from .digest import digest, union_size
from .extract import STOPWORDS, Definition, mentions, plain_word, read, shaped
from .prose import (DETERMINERS, KIND_WORDS, NAMING_STOPWORDS, Lexicon, bagged, by_role, candidates, english,
                    is_common, is_object, is_thing, is_verb, keyed, root, split_name, variants)

LITERAL, DERIVED, LEXICAL = 2, 1, 0  # how a step named a definition


@dataclass(frozen=True)
class Need:
    """A definition (``message`` position, ``definition``) that step ``step`` needs, and how it was
    named (``LITERAL``, ``DERIVED`` from prose or a respelling, ``LEXICAL``). ``members``: for a class
    named as the owner of members the step names, those names (the class is then needed as their
    context, not whole). ``named``: whether the step names it in code, or in words and does not describe
    a need (a need too large for its room gets a full digest only then, else its head: a word that only
    looks like a name, "a Vortex expression", is too weak a reason)."""

    step: int
    message: int
    definition: Definition
    how: int
    members: frozenset[str] | None = None
    named: bool = True


class Plan(Blueprint):
    """A planner's blueprint, with what it needed, what of that it planned only as a digest
    (``partial``) and what it dropped to keep each step under ``cap`` tokens (and the live plan under
    the budget)."""

    def __init__(self, spans=(), *, needs=(), partial=(), dropped=(), cap=None):
        super().__init__(spans)
        self.needs: list[Need] = list(needs)
        self.partial: list[Need] = list(partial)
        self.dropped: list[Need] = list(dropped)
        self.cap = cap


def _path_parts(path: str) -> list[str]:
    parts = [p for p in path.replace("\\", "/").split("/") if p and p != "."]
    if parts:
        parts[-1] = parts[-1].rsplit(".", 1)[0]
        if parts[-1] == "__init__":
            parts.pop()
    return parts


def _absolute(target: str, path: str | None) -> str:
    """An import's dotted target made absolute against the importing file's package (``.rwbase.Writer``
    in ``nbformat/v4/nbjson.py`` is ``nbformat.v4.rwbase.Writer``), so that of two files that end with
    the same module the importer's sibling is found; without a path, the dots are dropped."""
    rest = target.lstrip(".")
    level = len(target) - len(rest)
    if not level:
        return target
    parts = [p for p in (path or "").replace("\\", "/").split("/") if p and p != "."]
    package = parts[:-1]  # the file's own directory (an __init__.py's too)
    if not parts or level - 1 > len(package):
        return rest
    return ".".join(package[:len(package) - (level - 1)] + ([rest] if rest else []))


def _shared_ending(parts: list[str], module: list[str]) -> int:
    """How many trailing parts a file's path and a dotted module share (``v4/rwbase`` and
    ``nbformat.v4.rwbase``: 2)."""
    k = 0
    while k < min(len(parts), len(module)) and parts[-1 - k] == module[-1 - k]:
        k += 1
    return k


class _Index:
    """The session's definitions by namespace, in message order (see the module docstring)."""

    def __init__(self, messages):
        self.messages = list(messages)
        self.top: dict[str, list] = {}
        self.facts: dict[str, list] = {}
        self.members: dict[tuple[str, str], list] = {}
        self.member_names: dict[str, list] = {}
        self.classes: dict[str, list] = {}
        self.aliases: dict[str, list] = {}
        self.entries: list[tuple[int, Definition]] = []
        self.paths: list[str | None] = []
        previous_paths: tuple[str, ...] = ()
        for i, m in enumerate(self.messages):
            r = read(m.content)
            own = r.paths[0] if r.paths and r.paths[0] in m.content.split("\n", 1)[0] else None
            path = own or (previous_paths[-1] if previous_paths else None)
            self.paths.append(path)
            previous_paths = r.paths
            for d in r.definitions:
                entry = (i, d)
                self.entries.append(entry)
                if d.kind == "fact":
                    self.facts.setdefault(d.name, []).append(entry)
                elif d.owner is None:
                    self.top.setdefault(d.name, []).append(entry)
                    if d.kind == "class":
                        self.classes.setdefault(d.name, []).append(entry)
                else:
                    self.members.setdefault((d.owner, d.name), []).append(entry)
                    self.member_names.setdefault(d.name, []).append(entry)
            for alias, target in r.imports:
                self.aliases.setdefault(alias, []).append((i, _absolute(target, path)))
        self.defined = set(self.top) | set(self.facts) | set(self.member_names)
        self.by_key = keyed(self.defined)
        self.by_bag = bagged(self.defined)
        self.heads: dict[tuple[str, str], set[str]] = {}  # names by kind and root of their last word
        for _, d in self.entries:
            kind = d.kind if d.owner is None else ("method" if d.kind == "method" else None)
            words = split_name(d.name)
            if kind in ("class", "function", "assignment", "method") and words:
                self.heads.setdefault((kind, root(words[-1])), set()).add(d.name)
        self._lexicon = None
        self._english = None

    def english(self, word: str) -> bool:
        """Whether ``word`` is an English word here: a stopword, keyword or builtin, or used as a word in
        the session's own prose at least twice (``pace_hf.planner.prose.english``)."""
        if self._english is None:
            self._english = english(m.content for m in self.messages)
        return plain_word(word) or self._english.get(word.lower(), 0) >= 2

    @property
    def lexicon(self) -> Lexicon:
        if self._lexicon is None:
            self._lexicon = Lexicon(self.entries)
        return self._lexicon

    def path_of(self, i: int, d: Definition) -> list[str]:
        path = d.path or self.paths[i]
        return _path_parts(path) if path else []

    @staticmethod
    def latest(table: dict, key, before: int):
        """The last entry of ``table[key]`` in a message before ``before``."""
        where = table.get(key)
        if not where:
            return None
        k = bisect.bisect_left([i for i, _ in where], before)
        return where[k - 1] if k else None

    # -- names --------------------------------------------------------------------------------------
    def name(self, name: str, before: int):
        """A bare name: top-level, else a prose fact, else a member of some class."""
        return self.latest(self.top, name, before) or self.latest(self.facts, name, before) \
            or self.latest(self.member_names, name, before)

    def base_class(self, entry, base: str, before: int):
        """The class that the base ``base`` (dotted, as written) of class ``entry`` names, never ``entry``
        itself (``class TextWrapper(textwrap.TextWrapper)``): a module written or imported (``import
        textwrap``; ``from .base import Base as B``) picks the class of the file whose path ends with it;
        else a class of the same message, else the latest."""
        i, _ = entry
        *qualifier, name = base.split(".")
        module = self.expand(qualifier, i + 1) if qualifier else []
        if not qualifier:
            alias = self.latest(self.aliases, name, i + 1)
            if alias and "." in alias[1]:
                *module, name = alias[1].split(".")
        found = [e for e in self.classes.get(name, ()) if e[0] < before and e != entry]
        if not found:
            return None
        if module:  # the file whose path ends with most of the module (the latest of those)
            endings = [(_shared_ending(self.path_of(*e), module), e) for e in found]
            best = max(k for k, _ in endings)
            if best:
                return next(e for k, e in reversed(endings) if k == best)
        return next((e for e in reversed(found) if e[0] == i), found[-1])

    def mro(self, cls, before: int) -> list:
        """The class entry ``cls`` (or the latest class of that name) and the bases the session defines,
        in C3 order (depth-first where C3 fails), each base found by :meth:`base_class`."""
        start = self.latest(self.classes, cls, before) if isinstance(cls, str) else cls
        if start is None:
            return []

        def bases(c):
            return [b for b in (self.base_class(c, base, before) for base in c[1].bases) if b is not None]

        def linearize(c, stack):
            if c in stack:
                return [c]
            seqs = [linearize(b, stack | {c}) for b in bases(c)] + [bases(c)]
            out = [c]
            seqs = [list(s) for s in seqs if s]
            while seqs:
                for s in seqs:
                    head = s[0]
                    if not any(head in t[1:] for t in seqs):
                        break
                else:  # no consistent order: fall back to depth first
                    return out + [x for s in seqs for x in s if x not in out]
                out.append(head)
                seqs = [t[1:] if t[0] == head else t for t in seqs]
                seqs = [t for t in seqs if t]
            return out

        return list(dict.fromkeys(linearize(start, frozenset())))

    def member(self, owner, name: str, before: int):
        """Member ``name`` of class ``owner`` (a name or a class entry) through its MRO: each class's own
        member, from the message that defines that class; else any class of that name's member."""
        classes = self.mro(owner, before)
        for i, cls in classes:
            got = [e for e in self.members.get((cls.name, name), ()) if e[0] == i]
            if got:
                return got[-1]
        for c in [cls.name for _, cls in classes] or [owner]:
            got = self.latest(self.members, (c, name), before)
            if got:
                return got
        return None

    def dotted(self, name: str, before: int, about=()):
        """A method named by ``.name()`` alone: the only class's that defines it, else that of the first
        class in ``about`` (the step's own classes, then the surrounding steps') that has it through its
        bases, else the latest."""
        where = [e for e in self.member_names.get(name, ()) if e[0] < before]
        if len({e[1].owner for e in where}) > 1:
            for cls in about:
                got = self.member(cls, name, before) if self.latest(self.classes, cls, before) else None
                if got:
                    return got
        return where[-1] if where else self.name(name, before)

    def expand(self, qualifier: list[str], before: int) -> list[str]:
        """A qualifier through the session's import aliases (``c`` -> ``a.b`` for ``import a.b as c``)."""
        got = self.latest(self.aliases, qualifier[0], before)
        return (got[1].split(".") + qualifier[1:]) if got else qualifier

    def chain(self, chain: tuple[str, ...], before: int):
        """``C.m`` (a member through the MRO) or ``mod.f`` (a top-level name of that file), else the last
        name alone."""
        *qualifier, name = chain
        qualifier = [q for q in qualifier if q not in ("self", "cls")]
        if not qualifier:
            return self.name(name, before)
        expanded = self.expand(qualifier, before)
        for owner in dict.fromkeys([qualifier[-1], expanded[-1]]):
            if self.latest(self.classes, owner, before) or self.latest(self.member_names, name, before):
                got = self.member(owner, name, before)
                if got:
                    return got
        for q in (expanded, qualifier):
            for i, d in reversed(self.top.get(name, [])):
                if i < before:
                    parts = self.path_of(i, d)  # the path and the module agree wherever both go
                    if parts and _shared_ending(parts, q) == min(len(parts), len(q)):
                        return i, d
        return self.name(name, before)

    def closure(self, i: int, d: Definition) -> list:
        """What a needed function also needs, as its own message saw it: the class of each field it uses
        on a parameter, when exactly one class declares a field of that name in its body
        (``settle(record)`` reads ``record.status``: the record's dataclass)."""
        out = []
        for f in d.fields:
            owners = {e[1].owner for e in self.member_names.get(f, ()) if e[0] <= i and e[1].kind == "field"
                      and e[1].owner != "?"}
            if len(owners) == 1:
                got = self.latest(self.classes, owners.pop(), i + 1)
                if got:
                    out.append(got)
        return out


DESCRIBED = 4  # content words from which a step describes a definition (the lexical ranker reads it)


def _described(words) -> int:
    """Content words of a step: not plain English or Python, not identifier-shaped, not "function"."""
    return sum(not plain_word(w) and not shaped(w) and w.lower() not in KIND_WORDS for w in words)


class SymbolPlanner:
    """Blueprints from what planned steps name (see the module docstring).

    Args:
        steps: the agent's plan, ``{future step number: step description}``.
        depth: 1 (default) adds the record classes whose fields a needed function uses; 0 plans only
            what the steps name.
        share: each step's plan stays under ``share * budget`` tokens (default 0.5).
        max_restore_tokens: the most tokens one ``rehydrate`` restores (default: half the cache budget).
    """

    def __init__(self, steps: dict[int, str] | None = None, *, depth: int = 1, share: float = 0.5,
                 max_restore_tokens: int | None = None):
        self.steps: dict[int, str] = {}
        self.depth = as_index(depth, "depth")
        if self.depth not in (0, 1):
            raise ValueError(f"depth must be 0 or 1, got {depth}")
        if not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0 < share <= 1):
            raise ValueError(f"share must be a number in (0, 1], got {share!r}")
        self.share = float(share)
        self.max_restore_tokens = None if max_restore_tokens is None else as_index(max_restore_tokens,
                                                                                   "max_restore_tokens")
        self._blueprint: Blueprint | None = None
        self._added: dict[tuple, Span] = {}
        self._offsets: dict[tuple, tuple] = {}
        self.last_plan: Plan | None = None
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
        """Names that ``text`` writes as code or as identifier-shaped words, without the keywords,
        builtins, stopwords and dunders that no session is needed to rule out (resolution against a
        session does not filter: there a defined ``print`` counts)."""
        return {n for n in mentions(text).names if not plain_word(n) and not (n.startswith("__") and n.endswith("__"))}

    def definitions(self, text: str) -> set[str]:
        """Names that ``text`` defines (top-level names, class members and prose facts)."""
        return {d.name for d in read(text).definitions}

    def needs(self, index: _Index, text: str, step: int, before: int, lexical: bool = True,
              nearby: tuple[str, ...] = ()) -> list[Need]:
        """What a step (or turn) ``text`` needs from the messages before position ``before``; ``lexical``:
        rank the definitions when the text names nothing literally (for plans, not for user turns);
        ``nearby``: the classes the surrounding steps are about, nearest first (a method named by
        ``.name()`` that several classes define is theirs)."""
        said = mentions(text)
        found: dict[tuple[int, Definition], int] = {}
        owners: dict[tuple[int, Definition], set[str]] = {}  # classes named as owners: member names

        def add(got, how):
            if got is not None:
                key = (got[0], got[1])
                found[key] = max(found.get(key, -1), how)

        chained = {n for c in said.chains for n in c}  # a chain is resolved whole, not name by name
        for chain in said.chains:
            got = index.chain(chain, before)
            add(got, LITERAL)
            qualifier = [q for q in chain[:-1] if q not in ("self", "cls")]
            owner = index.latest(index.classes, qualifier[-1], before) if got and got[1].owner and qualifier else None
            if owner and (owner[0] != got[0] or owner[1].name != got[1].owner):  # inherited (from a base of any
                owners.setdefault(owner, set())                                  # name): the subclass's header
                add(owner, LITERAL)                                              # is the context
        resolved: dict[str, tuple] = {}  # a bare name: (what it resolves to, how it was named)
        for name, how in said.names.items():
            if name in chained or name in said.dots:
                continue
            got = index.name(name, before)
            if got is not None:
                resolved[name] = (got, LITERAL if how == LITERAL else DERIVED)
            else:  # camelCase written for a snake_case name, or the other way round
                for v in variants(name, index.by_key):
                    resolved.setdefault(v, (index.name(v, before), DERIVED))
        described = bool(lexical and said.words) and _described(said.words) >= DESCRIBED
        words_in_any_order = None if described else index.by_bag  # in a description, a coincidence
        for name in candidates(said.words, index.by_key, words_in_any_order) | by_role(said.words, index.heads):
            resolved.setdefault(name, (index.name(name, before), DERIVED))
        # Plain words that are names the session defines ("after decodebytes runs"): a word that is not
        # English is the name; an English one only where it stands as a thing and nothing else is named.
        # In a description, or a step that also names code, they need more (pace_hf.planner.prose).
        # code: a name written as code that the session defines ("API" or "URL" in prose is no code here)
        code = bool(said.chains) or any(how == LITERAL for _, how in resolved.values()) \
            or any(said.names.get(d) == LITERAL and index.name(d, before) for d in said.dots)
        joined = {w for name in resolved for w in split_name(name)}  # "templates not found": one name, joined
        bare = [(w, p, n, o) for w, p, n, start, o in said.bare if w not in resolved and w in index.defined
                and w.lower() not in joined
                and (w.lower() not in STOPWORDS or w.lower() in NAMING_STOPWORDS) and not is_verb(p, o)
                and not (start and w[0].isupper() and index.english(w))
                and not (w.lower() in KIND_WORDS and not is_thing(p, n, before=o))  # "the local variables"
                and not (code and not is_thing(p, n, strict=True, before=o))]
        english = [(w, p, n, o) for w, p, n, o in bare if index.english(w)]
        query = list(said.words) + list(said.names)
        for w, p, n, o in bare:
            if (w, p, n, o) not in english and (not described or is_thing(p, n, strict=True, before=o)
                                                or p not in DETERMINERS and is_thing(p, n, before=o, english=False)
                                                or not is_common(p, n, o, english=False) and index.lexicon.near_best(
                                                    query, before, index.name(w, before))):
                resolved.setdefault(w, (index.name(w, before), DERIVED))
        # in a description a thing's place must be strict, or, but after a determiner ("the parser for this
        # node": a common noun), the word must also be among the best lexical matches of the step's words
        # ("I changed eval yesterday and now the build fails")
        things = {w for w, p, n, o in english if is_thing(p, n, strict=described, before=o) or described
                  and p not in DETERMINERS and is_thing(p, n, before=o)
                  and index.lexicon.near_best(query, before, index.name(w, before))}
        if len(things) > 1:  # "once relation returns, ... close the file": the one where a common noun rarely is
            things = {w for w, p, n, o in english if w in things and (is_thing(p, n, strict=True, before=o)
                                                                      or is_object(p, o) and not is_common(p, n, o))}
        if len(things) == 1 and not said.chains and not said.dots and not any(got for got, _ in resolved.values()):
            w = things.pop()
            resolved[w] = (index.name(w, before), DERIVED)
        # A class and a name in one step ("subclass `Retry` and override `sleep`", "the get bucket method
        # of the bytecode cache"): the name is the class's member, through its bases, and the class is
        # needed as that member's context.
        classes = {got for got, _ in resolved.values() if got and got[1].kind == "class"}
        for cls in classes:
            for name, (got, how) in list(resolved.items()):  # a top-level name stays top-level
                member = None if got is None or got[1].owner is None else index.member(cls, name, before)
                if member:
                    resolved[name] = (member, how)
                    owners.setdefault(cls, set()).add(name)
        for name in said.dots:  # `.put()`: a method, of the only class that defines it, else of a class
            resolved[name] = (index.dotted(name, before, [c[1].name for c in classes] + list(nearby)), LITERAL)
        for got, how in resolved.values():
            add(got, how)
        if lexical and not found and said.words and (LITERAL not in said.names.values() or described):
            # a step that names nothing the session defines: prose, or a description whose only names
            # come from elsewhere ("... into a CookieJar", an imported class): the lexical ranker
            for got in index.lexicon.rank(list(said.words) + list(said.names), before):
                add(got, LEXICAL)
        elif found and described:
            # a description that also names other definitions ("the inverse of `parseaddr()`, this
            # takes ..."): its best lexical match joins them if it clearly outranks every one it named
            add(index.lexicon.outranking(list(said.words) + list(said.names), before, set(found)), LEXICAL)
        # a full digest for what the step names in code, or in words in a step that does not describe what
        # it needs (in a description a word that looks like a name is often a coincidence: "a Vortex
        # expression"); what else does not fit whole gets its head only
        named = {key for key, how in found.items() if how == LITERAL or how == DERIVED and not described}
        if self.depth:
            for (i, d), how in list(found.items()):
                for got in index.closure(i, d):
                    add(got, min(how, DERIVED))
        return [Need(step, i, d, how, frozenset(owners[(i, d)]) if (i, d) in owners else None, (i, d) in named)
                for (i, d), how in found.items()]

    def _digest(self, index: _Index, need: Need, text: str, template, room: int, context: bool = False):
        """Token spans of ``need``'s digest within ``room`` tokens (``pace_hf.planner.digest``)."""
        d, message = need.definition, index.messages[need.message]
        relevance = {}
        if not context and d.outline is not None:
            said = mentions(text)
            scores = index.lexicon.scores(list(said.words) + list(said.names), need.message + 1)
            if scores is not None:
                relevance = {e.name: float(scores[j]) for j, (i, e) in enumerate(index.lexicon.entries)
                             if i == need.message and e.owner == d.name}
        said = mentions(text)
        named = set(need.members or ()) | set(said.names) | set(said.dots)
        return digest(d, named, relevance, room, lambda parts: self._tokens(message, template, parts),
                      context=context, words={w for w in said.words if not plain_word(w)})

    def _tokens(self, message, template, parts) -> list[tuple[int, int]]:
        """Absolute token spans of a definition's character ``parts`` in ``message``."""
        if template is None:
            return [(message.start, message.end)]
        key = (message.role, message.content, message.start)
        if key not in self._offsets:
            if len(self._offsets) > 4096:
                self._offsets.clear()
            offsets, _, at = template.content_offsets(message.role, message.content)
            self._offsets[key] = (offsets, at)
        offsets, at = self._offsets[key]
        out = []
        for a, b in parts:
            got = offsets.span(a + at, b + at)
            if got is not None:
                s, e = message.start + got[0], min(message.start + got[1], message.end)
                if e > s:
                    out.append((s, e))
        return out

    # -- planning -----------------------------------------------------------------------------------------
    def blueprint_for(self, messages, steps: dict[int, str] | None = None, *, template=None,
                      budget: int | None = None, now: int = 0) -> Plan:
        """The plan for ``messages`` (objects with ``role``, ``content``, ``start``, ``end``, ``step``, in
        order) and the planned ``steps`` (default: this planner's) whose readers come after step ``now``.
        ``template`` (a ``pace_hf.chat.ChatTemplate``) maps definitions to tokens; ``budget`` caps each
        step's plan at ``share * budget`` tokens and the live plan at ``budget``."""
        steps = self.steps if steps is None else steps
        index = _Index(messages)
        msg_steps = [m.step for m in index.messages]
        wanted, needs = [], {}
        for step, text in sorted(steps.items()):
            if step > now:
                needs[step] = self.needs(index, text, step, bisect.bisect_left(msg_steps, step))
        about = {step: [n.definition.name if n.definition.kind == "class" else n.definition.owner for n in got
                        if n.definition.kind == "class" or n.definition.owner not in (None, "?")]
                 for step, got in needs.items()}
        order = sorted(needs)
        for k, step in enumerate(order):
            if mentions(steps[step]).dots:  # `.put()`: the classes the surrounding steps are about, nearest first
                nearby = sorted(order[:k] + order[k + 1:], key=lambda s: (abs(s - step), s > step))
                needs[step] = self.needs(index, steps[step], step, bisect.bisect_left(msg_steps, step),
                                         nearby=tuple(c for s in nearby for c in about[s]))
            for need in needs[step]:
                spans = self._tokens(index.messages[need.message], template, need.definition.parts)
                if spans:
                    wanted.append((need, spans))
        cap = None if budget is None else int(self.share * as_index(budget, "budget"))
        wanted.sort(key=lambda w: (w[0].step, -w[0].how, sum(e - s for s, e in w[1])))
        kept, partial, dropped, over, live, per_step = [], [], [], [], [], {}
        for need, spans in wanted:
            mine = per_step.setdefault(need.step, [])
            if need.members is not None:  # a class named as the owner of members: their context
                spans = self._digest(index, need, steps[need.step], template, union_size(spans), context=True)
            if cap is not None and (union_size(mine + spans) > cap or union_size(live + spans) > budget):
                over.append(need)
                continue
            mine += spans
            live += spans
            kept.append((need, spans))
        # then digests of what did not fit whole, in the room that whole needs left: named ones first, each
        # a fair share of what is left in its step and in the live plan (what one leaves unused goes to the
        # next), so that every need gets a part of itself
        over.sort(key=lambda n: (n.step, not n.named, -n.how))
        for k, need in enumerate(over):
            mine = per_step[need.step]
            sharing = sum(1 for n in over[k:] if n.step == need.step)
            room = min((cap - union_size(mine)) // sharing, (budget - union_size(live)) // (len(over) - k))
            spans = self._digest(index, need, steps[need.step], template, room,  # not named in code: its head
                                 context=need.members is not None or not need.named) if room > 0 else []
            if not spans:
                dropped.append(need)
                continue
            partial.append(need)
            mine += spans
            live += spans
            kept.append((need, spans))
        plan = Plan(_segments(kept), needs=[n for n, _ in kept], partial=partial, dropped=dropped, cap=cap)
        self.last_plan = plan
        return plan

    def plan(self, session) -> Plan:
        """Bring ``session.cache.blueprint`` up to date with the session's messages and the plan."""
        blueprint = session.cache.blueprint
        if blueprint is None:
            raise ValueError("SymbolPlanner needs a cache with a Foresight policy (PACECache)")
        if blueprint is not self._blueprint:
            self._blueprint, self._added = blueprint, {}
        plan = self.blueprint_for(session.messages, template=getattr(session, "template", None),
                                  budget=getattr(session.cache, "budget", None), now=getattr(session, "step", 0))
        want = {(s.start, s.end, s.readers): s for s in plan}
        for key in [k for k in self._added if k not in want]:  # stale: redefined, or readers changed
            blueprint.remove(self._added.pop(key))
        held = {(s.start, s.end, s.readers) for s in blueprint}
        for key, span in want.items():
            if key not in self._added and key not in held:  # held: e.g. saved before a resume
                self._added[key] = blueprint.add(span)
        return plan

    # -- rehydration --------------------------------------------------------------------------------------
    def rehydrate(self, session, message) -> list[Span]:
        """Bring back the definitions that the new turn ``message`` names (see the module docstring): the
        evicted part of one already prefilled is restored from the tiers; a part still to be prefilled
        is planned for the current step, so that prefill keeps it. Returns the spans planned for this
        step, most recent first."""
        messages = session.messages
        before = next((i for i, m in enumerate(messages) if m is message), None)
        if before is None:
            before = next((i for i, m in enumerate(messages) if m.index >= message.index), len(messages))
        index = _Index(messages[:before])
        cache = session.cache
        template = getattr(session, "template", None)
        seen = cache.get_seq_length()
        cache.step = session.step
        cap = self.max_restore_tokens if self.max_restore_tokens is not None else cache.quotas.planned_restore
        spans = {s for need in self.needs(index, message.content, session.step, before, lexical=False)
                 for s in self._tokens(messages[need.message], template, need.definition.parts)}
        planned, used = [], 0
        for start, stop in _merge(sorted(spans), gap=0)[::-1]:
            end = min(stop, seen)  # [start, end) is prefilled, [end, stop) is not yet
            evicted = start < end and cache.residency(range(start, end)) < 1.0
            pending = stop > end
            if not (evicted or pending) or used + (stop - start) > cap:
                continue
            if evicted:
                cache.restore(start, end)  # plans [start, end) for this step
            if pending:
                cache.blueprint.add(Span(max(end, start) if evicted else start, stop, [cache.step]))
            used += stop - start
            planned.append(Span(start, stop, [cache.step]))
        return planned


def _merge(spans: list[tuple[int, int]], gap: int = 0) -> list[tuple[int, int]]:
    """Sorted spans with overlapping or touching ones (at most ``gap`` tokens apart) merged."""
    out: list[list[int]] = []
    for s, e in spans:
        if out and s <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _segments(kept) -> list[Span]:
    """Disjoint spans, each with the steps that read every token of it; neighbours with the same
    readers are merged."""
    edges = sorted({p for _, spans in kept for s, e in spans for p in (s, e)})
    readers: dict[tuple[int, int], set[int]] = {}
    for need, spans in kept:
        for s, e in spans:
            lo, hi = bisect.bisect_left(edges, s), bisect.bisect_left(edges, e)
            for k in range(lo, hi):
                readers.setdefault((edges[k], edges[k + 1]), set()).add(need.step)
    out: list[Span] = []
    for (s, e), r in sorted(readers.items()):
        if out and out[-1].end == s and set(out[-1].readers) == r:
            out[-1] = Span(out[-1].start, e, out[-1].readers)
        else:
            out.append(Span(s, e, sorted(r)))
    return out
