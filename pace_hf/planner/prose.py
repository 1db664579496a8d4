"""Plans in prose: the names a developer's sentence means, and a lexical ranker for steps that name nothing.

A developer writes "fix how the version parser handles local tags", not "`VersionParser`". Two
readings turn such a step into the session's definitions:

* **Candidates** (:func:`candidates`): joins of adjacent words in any spelling the session uses
  ("parse version" -> ``parse_version``, ``parseVersion``, ``PARSE_VERSION``, ``_parse_version``: names
  are matched by a key without case or underscores; a plural last word also singular), the other
  spellings of the names it writes (:func:`variants`: camelCase for a snake_case name), and a single
  word right before a word that says it is code ("the open function"). Only names that the session
  defines are kept, so a candidate costs nothing when wrong.
* **Lexical ranking** (:class:`Lexicon`): BM25 (``bm25s``) over the session's definitions, each a
  document of its name split into words (weighted), its class's name, its signature and its docstring.
  Used for a step that resolves nothing through names: it finds single lowercase words the session
  defines ("fix the dispatch") and descriptions that name nothing at all.
* **Bare names** (:func:`is_thing`, :func:`english`): a plain word that is exactly a name the session
  defines ("after decodebytes runs"). A word that is no English word is taken as the name, unless a
  modal makes it a verb ("should stop"). An English one ("wait", "request") is a name only where the
  sentence's grammar makes it a thing (after "the", "by", "inside" ...; before "should", "runs") and not
  a verb ("then wait for the build", "to wait for"), and only when it is the step's only candidate. In
  a description's many words a name that is a word is mostly a coincidence ("... into a YAML stream"):
  there an English word must be a subject, follow "by", "inside", "after" ..., or be a perfect's object
  ("has tested X": after "has" stands a participle, never an adjective), and one that is no
  English word must not stand as a verb or after "a", and score, by the lexical ranker, at least half
  the best match. In a step that also names code, any bare word must be a subject or follow "by",
  "inside", "after" ... ("Next, read `X`": the plan is `X`). A word is English here when the session's own
  prose (docstrings, comments, remarks) uses it between two lowercase words at least twice: the
  vocabulary of the code at hand, with no dictionary. Stopwords are never names, but for a few that
  code often uses as names (``write``, ``keep``, ``use``: English words, so they need the grammar too);
  a kind word ("variables", "fields") is a name only where it stands as a thing ("the local variables":
  the kind word).
"""

from __future__ import annotations

import logging
import re

import bm25s
import numpy as np

from .extract import STOPWORDS, Definition

# bm25s sets its own logger to DEBUG at import, so every index it builds printed a DEBUG line through
# any root handler (pace-serve's default log showed one per turn): let the root level decide again.
logging.getLogger("bm25s").setLevel(logging.NOTSET)

# stopwords to the ranker, yet common names in code: a bare one may still be the name ("I suspect write is
# leaking handles"), as an English word (see below)
NAMING_STOPWORDS = frozenset("write keep make use note step reply done".split())
KIND_WORDS = frozenset("""function functions method methods class classes constant constants helper helpers
attribute attributes field fields property properties decorator decorators variable variables""".split())


def split_name(name: str) -> list[str]:
    """``parse_version`` / ``parseVersion`` / ``HTTPAdapter`` -> lowercase words."""
    out = []
    for piece in re.split(r"[_\W]+", name):
        out += re.findall(r"[A-Z]+(?=[A-Z][a-z]|\d|\b)|[A-Z]?[a-z]+|[A-Z]+|\d+", piece)
    return [w.lower() for w in out if w]


def _stem(word: str) -> str:
    """A light stem so that "parsers", "parser" and "parse" meet: plural and agent/verb endings."""
    w = word.lower()
    for suffix in ("ies", "ing", "ers", "er", "es", "ed", "s"):
        if len(w) > len(suffix) + 2 and w.endswith(suffix) and not w.endswith("ss"):
            return w[: -len(suffix)] + ("y" if suffix == "ies" else "")
    return w


def key(name_or_words) -> str:
    """The spelling-free key of a name or a word sequence: ``parse_version``, ``parseVersion``,
    ``PARSE_VERSION`` and "parse version" all give ``parseversion``."""
    words = name_or_words if isinstance(name_or_words, (list, tuple)) else [name_or_words]
    return "".join(w.lower() for w in words).replace("_", "")


def keyed(names) -> dict[str, set[str]]:
    """Names by :func:`key`."""
    out: dict[str, set[str]] = {}
    for name in names:
        out.setdefault(key(name), set()).add(name)
    return out


def root(word: str) -> str:
    """:func:`_stem` without a final "e" or a doubled final consonant: "parse", "parser" and "parsing"
    meet, and "split" and "splitting"."""
    w = _stem(word)
    if w != word.lower() and len(w) > 3 and w[-1] == w[-2] and w[-1] not in "aeiouslz":
        return w[:-1]
    return w[:-1] if len(w) > 3 and w.endswith("e") else w


def bag(words) -> frozenset[str]:
    """The roots of the content words of a name or phrase, in any order: "version parsing" and
    ``parse_version`` give the same bag."""
    return frozenset(root(w) for w in words if w.lower() not in STOPWORDS)


def bagged(names) -> dict[frozenset[str], set[str]]:
    """Names of two words or more by :func:`bag` of their words."""
    out: dict[frozenset[str], set[str]] = {}
    for name in names:
        words = split_name(name)
        if len(bag(words)) >= 2:
            out.setdefault(bag(words), set()).add(name)
    return out


# Grammar around a bare word (lowercase neighbours, or the punctuation there). A thing follows these ...
# after a preposition stands a thing, never a verb: "a docstring for parse that covers ..."
PREPOSITIONS = frozenset("""of by in inside into from with within via through around after before about on at
for over under against without than like per across behind beyond toward towards unlike despite besides except
near onto upon beside between among along amid past versus""".split())
THING_BEFORE = frozenset("""the call calls calling called use uses using whether does did if when once""".split()) \
    | PREPOSITIONS | frozenset("both either neither".split())  # "Both X and its tests"
# a new clause: "to X so it cannot block" (like a full stop: "to X." is no infinitive with an object)
CLAUSE_OPENERS = frozenset("so because although though whereas".split())
# ... of which these rarely introduce a common noun ("raised by X", "after X"; not "the stream")
NAME_BEFORE = frozenset("""by inside within call calls calling called after before around through via whether
does did once""".split())
# ... or is the subject of one of these (an auxiliary; a third-person verb is any "-s" word: "runs")
SUBJECT_OF = frozenset("""should must can could will would may might does did is was has had isn't doesn't
can't won't shouldn't""".split())
# a common noun's, in a description mostly a coincidence ("the parser for this node")
DETERMINERS = frozenset("the this that these those its their our your his her".split())
# after a verb comes its object: "wait for the build", "print the result"
OBJECT_START = frozenset("the a an for until on up out it them this that these those all some".split())
# after one of these comes a verb: "should stop swallowing"
MODALS = frozenset("should must can could will would may might shall".split())
# ... but one that opens a sentence asks a question, and its subject comes first: "Can X be made safe?"
AUXILIARIES = MODALS | frozenset("do does did is are was were has have had".split())
# ... and so does one after a question word: "How often is X called?", "Why is X slow?"
QUESTION_WORDS = frozenset("how why when where what which who often long much many".split())
# after a subject pronoun comes its verb: "We X the ...", "Let us X"
PRONOUNS = frozenset("i we you they he she it us".split())
# words that open a sentence without being its verb: "Please X", "Yesterday X broke"
OPENERS = frozenset("""please next first finally meanwhile however instead otherwise later today yesterday
tomorrow perhaps maybe hopefully currently apparently honestly""".split())


PERFECT = frozenset("has have had having 've".split())  # "has tested X": a verb's object, never an adjective's noun


def is_verb(previous: str, before: str = "") -> bool:
    """Whether a word after ``previous`` is a verb whatever it is ("should stop", "we inline"): never a
    name. Not after a modal that opens the sentence (``before`` is "."): "Should X validate ...?" asks
    about X."""
    return previous in MODALS and before != "." or previous in PRONOUNS


def is_s_form(word: str) -> bool:
    """Whether ``word`` ends in a plural's or a third person's "-s" ("tests", "returns"; not "class")."""
    return word.endswith("s") and not word.endswith("ss")


def is_perfect(previous: str, before: str = "") -> bool:
    """Whether a word after ``previous`` is the object of a perfect ("has tested X", "have changed X"):
    after "has" only a participle stands, so the word after it is a verb's object, not a noun an
    adjective qualifies ("the parsed value")."""
    return before in PERFECT and previous.isalpha() and previous not in STOPWORDS | AUXILIARIES


def is_object(previous: str, before: str = "") -> bool:
    """Whether a word after ``previous`` stands as a verb's object: after a past form ("I changed X
    yesterday", "has tested X with") or a verb that opens the sentence ("Keep X stable"; not a
    determiner, pronoun or auxiliary there: "The X", "We X", "Can X"). ``before``: what stands before
    ``previous`` ("." where it opens the sentence)."""
    if before == ".":  # an imperative, not a subject ("Users complained") or a sentence adverb ("Please X")
        return previous.isalpha() and not is_s_form(previous) and previous not in STOPWORDS | AUXILIARIES | OPENERS
    past = len(previous) > 4 and previous.endswith("ed") and previous not in STOPWORDS
    # "the release deprecates X": an "-s" word after a noun (not after a determiner: "the tests X")
    third_person = len(previous) > 3 and is_s_form(previous) \
        and previous not in STOPWORDS and before.isalpha() and before not in STOPWORDS | DETERMINERS | PRONOUNS
    verb = before in PRONOUNS | MODALS and previous.isalpha() and previous not in STOPWORDS  # "we inline X"
    # "our metrics show X": the verb of a plural subject (a noun, not a determiner's: "these tests")
    plural_subject = len(before) > 3 and is_s_form(before) and before.isalpha() and before not in STOPWORDS \
        and previous.isalpha() and not is_s_form(previous) and previous not in STOPWORDS | AUXILIARIES
    return past or third_person or verb or plural_subject or is_perfect(previous, before)


def is_common(previous: str, following: str, before: str = "", english: bool = True) -> bool:
    """Whether a word between ``previous`` and ``following`` stands where a name rarely does: a verb
    ("to wait for", "wait for the build", "read `X`": a backquote is where code stood; not where it is a
    verb's object, "blames X for the spike", or a preposition's, "for parse that covers") or a common
    noun ("a stream"). ``english``: whether the word is an English word; one that is not is no infinitive
    ("add a timeout to setdefault so ...")."""
    infinitive = english and previous == "to" and following not in CLAUSE_OPENERS and following not in ".;:!?"
    return is_verb(previous, before) or previous in ("a", "an") or infinitive \
        or following in OBJECT_START and previous not in PREPOSITIONS | {"the", "this", "that"} \
        and not is_object(previous, before) or following == "`"


def is_thing(previous: str, following: str, strict: bool = False, before: str = "", english: bool = True) -> bool:
    """Whether an English word between ``previous`` and ``following`` (lowercase words or punctuation)
    stands where a sentence puts a thing, not a verb (see the module docstring): after a determiner or
    a preposition, as the subject of a verb ("wait returns", "wait's", "Can wait be ..."), or as a
    verb's object with no determiner ("I changed wait", "Keep wait ..."; a common noun would have one).
    ``strict``: only where a common noun rarely stands (a subject, after "by", "inside", "after" ..., or
    the object of a perfect: "has tested wait"): for descriptions. ``before``: what stands before
    ``previous`` ("." where it opens the sentence); ``english``: whether the word is an English word (one
    that is not stands as a thing after "to" too: "add a timeout to setdefault")."""
    if is_common(previous, following, before, english):
        return False
    if not english and previous == "to":
        return True
    third_person = len(following) > 3 and is_s_form(following) and following not in STOPWORDS
    subject = following in SUBJECT_OF or third_person or following.startswith("'") \
        or previous in AUXILIARIES and (before == "." or before in QUESTION_WORDS)
    return subject or previous in (NAME_BEFORE if strict else THING_BEFORE) or is_perfect(previous, before) \
        or not strict and is_object(previous, before)


_BETWEEN_WORDS = re.compile(r"(?<=[a-z,] )([a-z]+)(?= [a-z])")


def english(texts) -> dict[str, int]:
    """How often each lowercase word stands between two lowercase words in ``texts``: its use as a word
    in the session's prose (a name is rarely written so; an English word is)."""
    counts: dict[str, int] = {}
    for text in texts:
        for w in _BETWEEN_WORDS.findall(text):
            counts[w] = counts.get(w, 0) + 1
    return counts


ROLE_KINDS = {"class": "class", "classes": "class", "function": "function", "functions": "function",
              "helper": "function", "helpers": "function", "method": "method", "methods": "method",
              "constant": "assignment", "constants": "assignment"}


def by_role(words: tuple[str, ...], heads: dict[tuple[str, str], set[str]]) -> set[str]:
    """Names a step gives by their role: "the", then a word that is the head (last) word of exactly one
    name of the kind that follows ("the wrapper class": ``TextWrapper``; "a coroutine function" in a
    description is no reference).
    ``heads``: names by ``(kind, root of their last word)``."""
    out = set()
    for the, word, kind in zip(words, words[1:], words[2:]):
        kind = ROLE_KINDS.get(kind.lower())
        if kind and the.lower() == "the" and word.lower() not in STOPWORDS:
            found = heads.get((kind, root(word.lower())), set())
            if len(found) == 1:
                out |= found
    return out


def variants(name: str, by_key: dict[str, set[str]]) -> set[str]:
    """The other spellings of a written name that the session defines (camelCase for snake_case ...)."""
    return by_key.get(key(name), set()) - {name}


def candidates(words: tuple[str, ...], by_key: dict[str, set[str]],
               by_bag: dict[frozenset[str], set[str]] | None = None) -> set[str]:
    """Names that a prose step means, among the session's (``by_key``, from :func:`keyed`): joins of 2-8
    adjacent words (a test's name runs long: "the test copy glob to existing directory method"; not all
    of them stopwords; a plural last word also singular), and a single word
    right before a word like "function" ("the open function"). The longest join wins: "value token
    class" means ``ValueToken``, not also ``Token``. Then, with ``by_bag`` (from :func:`bagged`), the
    words left: 2-4 adjacent content words (no stopword between them) that are the words of exactly one
    name, in any order and inflection ("the version parsing function": ``parse_version``)."""
    out: set[str] = set()
    lower = [w.lower() for w in words]
    used = [False] * len(words)

    def spans(sizes):
        for n in sizes:
            for i in range(len(words) - n + 1):
                chunk = lower[i:i + n]
                # a kind word is the name's own where the kind follows it: "the with attribute function"
                kind_after = i + n < len(words) and lower[i + n] in KIND_WORDS
                if not any(used[i:i + n]) and not all(w in STOPWORDS for w in chunk) \
                        and (kind_after and n > 1 or not any(w in KIND_WORDS for w in chunk)):
                    yield i, n, chunk

    for i, n, chunk in spans((8, 7, 6, 5, 4, 3, 2, 1)):
        if any(used[i:i + n]) or (n == 1 and not (i + 1 < len(words) and lower[i + 1] in KIND_WORDS)):
            continue
        found = by_key.get(key(chunk), set())
        if not found and chunk[-1].endswith("s") and len(chunk[-1]) > 3:
            found = by_key.get(key(chunk)[:-1], set())
        if found:
            out |= found
            used[i:i + n] = [True] * n
    for i, n, chunk in spans((4, 3, 2) if by_bag else ()):
        if any(used[i:i + n]) or any(w in STOPWORDS for w in chunk):
            continue
        found = by_bag.get(bag(chunk), set())
        if len(found) == 1:
            out |= found
            used[i:i + n] = [True] * n
    return out


def bm25_index(docs: list[list[str]]) -> bm25s.BM25:
    """A ``bm25s`` index over tokenized ``docs`` (the planner's and page retrieval's). An empty
    document gets one word no query has: bm25s cannot index a corpus of empty documents."""
    index = bm25s.BM25()
    index.index([doc or ["_"] for doc in docs], show_progress=False)
    return index


class Lexicon:
    """BM25 over a list of ``(message position, Definition)`` (see the module docstring)."""

    NAME_WEIGHT = 3

    def __init__(self, entries: list[tuple[int, Definition]]):
        self.entries = entries
        docs = [self._document(d) for _, d in entries]
        self.where = np.array([i for i, _ in entries], dtype=np.int64)
        self.position = {entry: j for j, entry in enumerate(entries)}
        self.bm25 = bm25_index(docs) if entries else None

    def _document(self, d: Definition) -> list[str]:
        name = [_stem(w) for w in split_name(d.name)]
        owner = [_stem(w) for w in split_name(d.owner)] if d.owner and d.owner != "?" else []
        doc = [_stem(w) for token in re.findall(r"[A-Za-z][A-Za-z0-9_]*", d.doc) for w in split_name(token)]
        return name * self.NAME_WEIGHT + owner + [w for w in doc if w not in STOPWORDS]

    @staticmethod
    def query(words) -> list[str]:
        return list(dict.fromkeys(_stem(w) for word in words for w in split_name(word) if w not in STOPWORDS))

    def scores(self, words, before: int) -> np.ndarray | None:
        """BM25 scores of every definition for ``words``, 0 for those in messages from ``before`` on; None
        when there is nothing to rank."""
        q = self.query(words)
        if self.bm25 is None or not q:
            return None
        scores = np.asarray(self.bm25.get_scores(q), dtype=np.float64)
        scores[self.where >= before] = 0.0
        return scores

    def near_best(self, words, before: int, entry, ratio: float = 0.5) -> bool:
        """Whether ``entry`` (a ``(message position, Definition)`` pair) scores at least ``ratio`` of the
        best definition's score for ``words``."""
        scores = self.scores(words, before)
        if scores is None or entry not in self.position:
            return False
        return scores[self.position[entry]] >= ratio * scores.max() > 0

    def rank(self, words, before: int, k: int = 1, ratio: float = 0.75) -> list[tuple[int, Definition]]:
        """The best definitions in messages before ``before``: the top one and any within ``ratio`` of its
        score, at most ``k``."""
        scores = self.scores(words, before)
        if scores is None:
            return []
        order = np.argsort(-scores, kind="stable")[:k]
        if not len(order) or scores[order[0]] <= 0:
            return []
        best = scores[order[0]]
        return [self.entries[j] for j in order if scores[j] >= ratio * best]

    def outranking(self, words, before: int, known, ratio: float = 0.5) -> tuple[int, Definition] | None:
        """The best definition in messages before ``before``, if it is not one of ``known`` (``(message
        position, Definition)`` pairs) and none of them scores within ``ratio`` of it; else None."""
        scores = self.scores(words, before)
        if scores is None:
            return None
        best = int(np.argmax(scores))
        rival = max((scores[j] for j, entry in enumerate(self.entries) if entry in known), default=0.0)
        if scores[best] <= 0 or self.entries[best] in known or rival >= ratio * scores[best]:
            return None
        return self.entries[best]
