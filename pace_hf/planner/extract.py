"""What a message defines, where (character spans), and what a text mentions: ``ast`` over tool output.

The planner plans *definitions*, not messages: a step that needs ``parse_version`` needs its 150
tokens, not the 10K-token file that holds it. So every message is read into :class:`Definition`
records, each with the character ranges of its source in the message.

**Code regions.** A message is read, in this order, as:

1. a whole Python module (``ast.parse`` of the whole text): a ``cat`` of a file;
2. a notebook (``.ipynb`` JSON): each code cell, offsets mapped through the JSON string escapes;
3. a unified diff: each hunk's new side (context and ``+`` lines);
4. ``grep -n`` / ``rg`` hits (``path:line:text``): each run of consecutive lines of one file;
5. a line-numbered listing (``cat -n``, ``nl``, ``   12→text``, ``12:text``): the prefixes stripped;
6. markdown with fenced blocks (and ``<cell>`` blocks): only when the text did not parse whole, and
   never a fence inside a triple-quoted string (a docstring's example is not the code);
7. a fragment (a file cut mid-function): column-0 blocks parsed one by one, indented blocks dedented.

Every code line keeps its character range in the message, so an ``ast`` node maps back to the
message through its line numbers. What is not code is prose.

**Definitions** (whole lines; a decorated node starts at its first decorator):

* top-level: ``def``/``class``, and module-level assignments (also inside module-level ``if``/
  ``try``/``with``/``for``/``while``);
* members (their own namespace, keyed by class): methods, class attributes, nested classes and
  ``self.X = ...`` in methods. A member's span is its class's header lines plus its own lines;
* prose facts: a backquoted or identifier-shaped name followed by ``is``/``are``/``means``/
  ``equals``/``=`` ... (``MAX_RETRIES = 5``, "The VaultCode is 4471"). They are weak: a code
  definition of the same name always wins (an assistant's "`Span` is defined in x.py" is a remark,
  not a definition), and "is defined/declared/implemented in" is never a fact.

Imports are not definitions; they are read as aliases (``import a.b as c``: ``c`` is ``a.b``).

**Mentions** (of a step or a user turn): code (backquoted, fenced, or the whole text when it parses)
gives every NAME and every dotted chain (``C.m``, ``mod.f``); prose gives quoted names, identifier-
shaped words (``snake_case``, ``CamelCase``, ``UPPER``, a call ``f()``, a capitalized word inside a
sentence) and the plain words in order (for ``pace_hf.planner.prose``). Keywords, builtins and
stopwords are not filtered here: whether a name counts is decided by what the session defines.
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import keyword
import re
import textwrap
import tokenize
from dataclasses import dataclass, field
from functools import lru_cache

STOPWORDS = frozenset("""
a an the this that these those it its it's is are was were be been being am do does did done
and or not no nor but if then else when while for of to in on at by with from as into onto over under
up down out off about above below after before again further once here there all any both each few
more most other some such only own same so than too very can will just should would could may might
must shall we you he she they them their our your his her my me us i ok yes note step steps use
now back reply write see also e.g i.e etc vs via per how what which who why where make sure keep
""".split())
BUILTIN_NAMES = frozenset(keyword.kwlist) | frozenset(getattr(keyword, "softkwlist", ())) | frozenset(dir(builtins)) \
    | frozenset({"self", "cls"})

NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = re.compile(NAME + r"(?:\." + NAME + r")+")
_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.(?:py|pyi|ipynb))\b")
_INLINE = re.compile(r"`([^`\n]+)`")
_QUOTED = re.compile(r"(?<![\w`])(['\"])(" + NAME + r"(?:\." + NAME + r")*)\1(?!\w)")
_WORD = re.compile(r"(?<![\w.])(" + NAME + r"(?:\." + NAME + r")*)(?![\w])")
_FACT_VERB = r"(?:is|are|means|equals|denotes|stands\s+for|refers\s+to|=|:=)"
_NOT_FACT = re.compile(r"\s*(?:defined|declared|implemented|located|in|at|from|used|called|imported|"
                       r"not|also|now|still|the\s+same)\b")
_FACT = re.compile(r"(?:`(" + NAME + r")`|(?<![\w.`])(" + NAME + r")(?![\w`]))\s+" + _FACT_VERB + r"(?=\s)")
_REGEX_DEF = re.compile(r"^(?:async\s+def|def|class)\s+(" + NAME + r")"          # def f / class C
                        r"|^(" + NAME + r")\s*(?::[^=\n]*)?(?:[-+*/|&]?=)(?!=)", re.M)  # X = / X: T = / X +=
_NUMBERED = re.compile(r"^[ \t]*(\d+)(?:\t|→|[:|] ?| )(.*)$", re.M)
_GREP = re.compile(r"^((?:[\w.-]+/)*[\w.-]+\.\w+)([:-])(\d+)\2(.*)$", re.M)
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,\d+)? @@")
_FENCE_OPEN = re.compile(r"^[ \t]{0,3}(```+|~~~+)[^\n`]*$")
_FENCED = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)
_CELL = re.compile(r"<cell\b[^>\n]*>\n?(.*?)</cell>", re.S)
_TRIPLE = re.compile(r"\"\"\"|'''")


def plain_word(name: str) -> bool:
    """Whether a prose word is ordinary English or Python (a stopword, keyword or builtin): such a word
    names a definition only when written as code or next to a word like "function"."""
    return name.lower() in STOPWORDS or name in BUILTIN_NAMES or len(name) < 2 or name.isdigit()


def shaped(word: str) -> bool:
    """An identifier-shaped prose word: snake_case, CamelCase (inner capital) or UPPER_CASE."""
    return "_" in word.strip("_") or bool(re.search(r"[a-z0-9][A-Z]", word)) or \
        (sum(c.isupper() for c in word) >= 2 and not any(c.islower() for c in word))


def sentence_start(text: str, i: int) -> bool:
    """Whether position ``i`` of ``text`` starts a sentence, a line or a list item."""
    j = i - 1
    while j >= 0 and text[j] in " \t-*#>\"'([":
        j -= 1
    return j < 0 or text[j] in ".!?:\n"


# ------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Definition:
    """One definition in a message: ``name`` (a member of class ``owner``, or top-level when ``owner`` is
    None), its ``kind`` (top-level: function, class, assignment or fact; members: method, field for a
    class-body assignment, attribute for ``self.X = ...``) and the character ranges
    ``parts`` of its source in the message. ``doc``: its signature and docstring (for the lexical
    ranker); ``fields``: the attribute names a function reads or writes
    on its parameters (``record.status``); ``path``: the file it came from, when the text says;
    ``bases``: a class's bases as written (dotted); ``outline``: a class's header and members, a
    function's signature, docstring line and statement lines."""

    name: str
    owner: str | None
    kind: str
    parts: tuple[tuple[int, int], ...]
    bases: tuple[str, ...] = ()
    doc: str = ""
    path: str | None = None
    fields: frozenset[str] = frozenset()
    outline: Outline | None = None


@dataclass(frozen=True)
class Member:
    """One member of a class, as its class's outline holds it: ``name``, the character ranges of its
    ``signature`` (decorators and ``def`` line, or the whole assignment), of its docstring's first line
    (``doc``, or None), of its ``whole`` source, and the names it ``uses`` on ``self``."""

    name: str
    signature: tuple[int, int]
    doc: tuple[int, int] | None
    whole: tuple[int, int]
    uses: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Line:
    """A statement line of a function's body: its character range (a compound statement's header only),
    the names it uses (``Name`` ids and attribute names), and whether it returns (``return``)."""

    chars: tuple[int, int]
    names: frozenset[str]
    returns: bool = False


@dataclass(frozen=True)
class Outline:
    """What a digest of a definition too large to plan whole is made of (``pace_hf.planner.digest``): a
    class's ``header`` (decorators and ``class`` line) and its ``members`` in source order; a function's
    ``header`` (decorators and signature), its docstring's first line (``doc``) and its body's statement
    ``lines`` in source order."""

    header: tuple[int, int]
    members: tuple[Member, ...] = ()
    doc: tuple[int, int] | None = None
    lines: tuple[Line, ...] = ()


@dataclass(frozen=True)
class Region:
    """A piece of code in a message: its text and, for each of its lines, the character range of that
    line in the message (line ``k`` of ``code`` is ``lines[k - 1]``)."""

    code: str
    lines: tuple[tuple[int, int], ...]
    path: str | None = None

    def chars(self, first: int, last: int) -> tuple[int, int]:
        """The message range of code lines ``first..last`` (1-based, inclusive; clamped to the region,
        since ``ast`` also counts a lone carriage return as a line break)."""
        n = len(self.lines)
        first, last = min(max(first, 1), n), min(max(last, 1), n)
        return self.lines[first - 1][0], max(self.lines[first - 1][0], self.lines[last - 1][1])


@dataclass(frozen=True)
class Reading:
    """What one message holds: its definitions (in order), the aliases its imports bind, the ``.py``
    paths it names, and the character ranges that are prose."""

    definitions: tuple[Definition, ...] = ()
    imports: tuple[tuple[str, str], ...] = ()
    paths: tuple[str, ...] = ()
    prose: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Mentions:
    """What a step or a turn names: bare ``names`` (with how literally: 2 code or identifier-shaped,
    1 a capitalized word or a call), dotted ``chains``, the prose ``words`` in order, the names written
    after a dot alone (``dots``: `.put()`, a method) and the other prose words with their context
    (``bare``: ``(word, previous word, next word, starts a sentence, what stands before the previous
    word)`` ("." where the previous word opens a sentence),
    lowercase neighbours, or the punctuation between: a plain word may still be a name the session
    defines)."""

    names: dict[str, int] = field(default_factory=dict)
    chains: frozenset[tuple[str, ...]] = frozenset()
    words: tuple[str, ...] = ()
    dots: frozenset[str] = frozenset()
    bare: tuple[tuple[str, str, str, bool, str], ...] = ()


# ------------------------------------------------------------------------------------------- regions


def _lines(text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """``(start, end)`` of each line of ``text[start:end]`` (end excludes the newline)."""
    end = len(text) if end is None else end
    out, i = [], start
    while i <= end:
        j = text.find("\n", i, end)
        if j < 0:
            if i < end or not out:
                out.append((i, end))
            break
        out.append((i, j))
        i = j + 1
    return out


def parse_python(text: str) -> ast.Module | None:
    """``ast.parse`` of text from anywhere (tool output, a model's answer), or None when it is not Python.
    Every way the parser refuses text counts: a syntax error, a NUL, nesting past the recursion limit,
    and ``MemoryError``, which CPython's parser raises on about 3,000 bare words of prose."""
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _parses_whole(text: str) -> bool:
    if not text.strip():
        return False
    tree = parse_python(text)
    if tree is None:
        return False
    # A lone expression ("Noted", "fee_for") is as likely prose as code: read it as prose.
    return not all(isinstance(node, ast.Expr) for node in tree.body)


def _region(text: str, spans: list[tuple[int, int]], path=None, strip: int = 0) -> Region:
    code = "\n".join(text[s + strip:e] if e - s >= strip else "" for s, e in spans)
    return Region(code, tuple((min(s + strip, e), e) for s, e in spans), path)


def _last_path(text: str, before: int) -> str | None:
    found = _PATH.findall(text, 0, before)
    return found[-1] if found else None


def _notebook(text: str) -> list[Region] | None:
    """Code cells of ``.ipynb`` JSON, each line mapped to its characters inside the JSON strings."""
    if not text.lstrip().startswith("{") or '"cells"' not in text:
        return None
    try:
        nb = json.loads(text)
    except ValueError:
        return None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        return None
    out, cursor = [], 0
    for cell in nb["cells"]:
        key = text.find('"source"', cursor)
        if key < 0:
            break
        i = text.index(":", key) + 1
        while text[i].isspace():
            i += 1
        strings, j = [], i
        if text[i] == "[":
            j = i + 1
            while True:
                while text[j] in " \t\r\n,":
                    j += 1
                if text[j] != '"':
                    break
                end = _json_string_end(text, j)
                strings.append((j, end))
                j = end
        else:
            strings.append((i, _json_string_end(text, i)))
            j = strings[-1][1]
        cursor = j
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        lines: list[tuple[int, int]] = []
        pieces: list[str] = []
        line_start = None
        for s, e in strings:  # a line may run across strings; a "\n" escape ends one
            inner_s, inner_e = s + 1, e - 1
            line_start = inner_s if line_start is None else line_start
            for m in re.finditer(r"\\(?:u[0-9a-fA-F]{4}|.)", text[inner_s:inner_e]):
                if m.group() == "\\n":
                    lines.append((line_start, inner_s + m.start()))
                    line_start = inner_s + m.end() if inner_s + m.end() < inner_e else None
            pieces.append(json.loads(text[s:e]))
        if line_start is not None and strings:
            lines.append((line_start, strings[-1][1] - 1))
        code = "".join(pieces)
        n = code.count("\n") + (0 if code.endswith("\n") else 1)
        if lines and n == len(lines):
            out.append(Region(code.rstrip("\n"), tuple(lines)))
    return out


def _json_string_end(text: str, i: int) -> int:
    """The index after the JSON string that starts with the quote at ``i``."""
    j = i + 1
    while text[j] != '"':
        j += 2 if text[j] == "\\" else 1
    return j + 1


def _diff(text: str) -> list[Region] | None:
    """The new side of each hunk of a unified diff (context and added lines)."""
    if not re.search(_HUNK.pattern, text, re.M):
        return None
    out, path, spans = [], None, []

    def close():
        if spans:
            out.append(_region(text, spans, path, strip=1))
            spans.clear()

    for s, e in _lines(text):
        line = text[s:e]
        if line.startswith("+++ "):
            close()
            path = re.sub(r"^[ab]/", "", line[4:].split("\t")[0].strip())
        elif _HUNK.match(line) or line.startswith(("diff ", "--- ", "index ")):
            close()
        elif line.startswith((" ", "+")) or line == "":
            spans.append((s, e))
        elif line.startswith("-") or line.startswith("\\"):
            continue
        else:
            close()
    close()
    return out


def _grep(text: str) -> list[Region] | None:
    """``path:line:text`` hits (``-`` for context lines): runs of consecutive lines of one file."""
    rows = []
    lines = _lines(text)
    for s, e in lines:
        m = _GREP.match(text, s, e)
        if m:
            rows.append((m.group(1), int(m.group(3)), m.start(4), e))
    nonempty = sum(1 for s, e in lines if text[s:e].strip() and text[s:e].strip() != "--")
    if not rows or len(rows) < 0.6 * nonempty:
        return None
    out, run = [], []
    for row in rows:
        if run and (row[0] != run[-1][0] or row[1] != run[-1][1] + 1):
            out.append(Region("\n".join(text[s:e] for _, _, s, e in run), tuple((s, e) for _, _, s, e in run), run[0][0]))
            run = []
        run.append(row)
    if run:
        out.append(Region("\n".join(text[s:e] for _, _, s, e in run), tuple((s, e) for _, _, s, e in run), run[0][0]))
    return out


def _numbered(text: str) -> list[Region] | None:
    """A line-numbered listing: runs of lines numbered n, n+1, ... (blank lines, as ``nl`` prints them,
    stay in the run); each line's number and separator stripped."""
    lines = _lines(text)
    hits = {}
    for k, (s, e) in enumerate(lines):
        m = _NUMBERED.match(text, s, e)
        if m:
            hits[k] = (int(m.group(1)), m.start(2))
    nonempty = sum(1 for s, e in lines if text[s:e].strip())
    if len(hits) < 3 or len(hits) < 0.6 * nonempty:
        return None
    out, run, last = [], [], None
    for k, (s, e) in enumerate(lines):
        if k in hits:
            n, code_start = hits[k]
            if run and last is not None and n != last + 1:
                out.append(run)
                run = []
            run.append((code_start, e))
            last = n
        elif not text[s:e].strip() and run:
            run.append((e, e))  # an unnumbered blank line inside the listing
        else:
            if run:
                out.append(run)
            run, last = [], None
    if run:
        out.append(run)
    return [Region("\n".join(text[s:e] for s, e in r), tuple(r), _last_path(text, r[0][0])) for r in out]


def _fenced(text: str) -> list[Region] | None:
    """Fenced blocks and ``<cell>`` blocks, skipping fence lines inside a triple-quoted string."""
    lines = _lines(text)
    out, inside, open_fence, in_string = [], None, None, None
    for s, e in lines:
        line = text[s:e]
        if open_fence is None:
            if in_string is None:
                m = _FENCE_OPEN.match(line)
                if m:
                    open_fence, inside = m.group(1), []
                    continue
            for q in _TRIPLE.findall(line):  # a docstring's fence is inside a string, not markdown
                in_string = q if in_string is None else (None if q == in_string else in_string)
        elif line.strip().startswith(open_fence[:3]) and line.strip().strip(open_fence[0]) == "":
            out.append(Region("\n".join(text[a:b] for a, b in inside), tuple(inside), _last_path(text, s)))
            open_fence, inside = None, None
        else:
            inside.append((s, e))
    if open_fence is not None and inside:
        out.append(Region("\n".join(text[a:b] for a, b in inside), tuple(inside), _last_path(text, len(text))))
    for m in _CELL.finditer(text):
        out.append(_region(text, _lines(text, m.start(1), m.end(1))))
    return out or None


def code_regions(text: str) -> list[Region]:
    """The code of a message (see the module docstring for the order of the readings)."""
    if _parses_whole(text):
        return [_region(text, _lines(text))]
    for reader in (_notebook, _diff, _grep, _numbered, _fenced):
        found = reader(text)
        if found is not None:
            return found
    region = _region(text, _lines(text))
    return [region] if _fragment_coverage(region.code) >= 0.5 else []


def _fragment_coverage(code: str) -> float:
    """The share of non-empty lines that sit in column-0 blocks that parse as statements (not bare
    expressions): how much a text that does not parse whole looks like cut-off code."""
    total = sum(1 for line in code.split("\n") if line.strip())
    if not total:
        return 0.0
    good = 0
    for _, block in _blocks(code):
        tree = parse_python(textwrap.dedent(block))
        if tree is None:
            continue
        if tree.body and not all(isinstance(n, ast.Expr) for n in tree.body):
            good += sum(1 for line in block.split("\n") if line.strip())
    return good / total


def _blocks(code: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of column-0 statement blocks (``else``/``except``/closers and a block's
    decorators stay attached)."""
    out, current, first = [], [], 1
    for k, line in enumerate(code.split("\n"), start=1):
        line += "\n"
        starts = line[:1] not in ("", " ", "\t", "\n", "\r", "#", ")", "]", "}") and \
            not re.match(r"(else|elif|except|finally|case)\b", line)
        if starts and current and not (current[-1].lstrip().startswith("@") and not current[-1].startswith((" ", "\t"))):
            out.append((first, "".join(current)))
            current, first = [], k
        current.append(line)
    if current:
        out.append((first, "".join(current)))
    return out


# ------------------------------------------------------------------------------------------- definitions


def _targets(node) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return []


def _module_statements(body):
    """Module-scope statements, through ``if``/``try``/``with``/``for``/``while`` bodies."""
    nested = (ast.If, ast.Try, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While) + \
        ((ast.TryStar,) if hasattr(ast, "TryStar") else ())
    for node in body:
        yield node
        if isinstance(node, nested):
            for attr in ("body", "orelse", "finalbody"):
                yield from _module_statements(getattr(node, attr, []) or [])
            for handler in getattr(node, "handlers", []) or []:
                yield from _module_statements(handler.body)


def _first_line(node) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def _fields(node) -> frozenset[str]:
    """Attribute names used on a function's parameters (not ``self``/``cls``): ``record.status``."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return frozenset()
    a = node.args
    params = {arg.arg for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs] if arg.arg not in ("self", "cls")}
    return frozenset(sub.attr for sub in ast.walk(node) if isinstance(sub, ast.Attribute)
                     and isinstance(sub.value, ast.Name) and sub.value.id in params)


def _signature(node) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        a = node.args
        return " ".join(arg.arg for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                        if arg and arg.arg not in ("self", "cls"))
    if isinstance(node, ast.ClassDef):
        return " ".join(_dotted(b) or "" for b in node.bases)
    return ""


def _doc(node) -> str:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        text = ast.get_docstring(node, clean=False) or ""
        return _signature(node) + " " + " ".join(text.split()[:80])
    return ""


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Subscript):  # Generic[T], Base[int]
        return _dotted(node.value)
    return None


def _class(node: ast.ClassDef, region: Region, base: int, path) -> list[Definition]:
    """A class and its members; every member's parts start with the class's header lines."""
    first = _first_line(node) + base
    body_first = _first_line(node.body[0]) + base
    header = region.chars(first, max(node.lineno + base, body_first - 1))
    bases = tuple(d for d in map(_dotted, node.bases) if d)  # dotted: ``textwrap.TextWrapper``
    out = [Definition(node.name, None, "class", (region.chars(first, node.end_lineno + base),), bases,
                      _doc(node), path, outline=_outline(node, region, base, header))]
    members: dict[str, Definition] = {}

    def member(name, stmt, kind, rebinds=True):
        """A later binding in the class body wins (``@overload`` stubs, then the real method); a
        ``self.X`` in a method only adds a member the body does not bind."""
        if name in members and not rebinds:
            return
        own = region.chars(_first_line(stmt) + base, stmt.end_lineno + base)
        parts = (header, own) if own[0] > header[1] else (region.chars(first, stmt.end_lineno + base),)
        members.pop(name, None)
        outline = _function_outline(stmt, region, base) if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) \
            else None
        members[name] = Definition(name, node.name, kind, parts, (), _doc(stmt), path,
                                   _fields(stmt), outline)

    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            member(stmt.name, stmt, "method")
        elif isinstance(stmt, ast.AnnAssign):
            for n in _targets(stmt.target):
                member(n, stmt, "field")
        elif isinstance(stmt, (ast.Assign, ast.AugAssign)):
            for target in getattr(stmt, "targets", None) or [stmt.target]:
                for n in _targets(target):
                    member(n, stmt, "field")
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(stmt):
                if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    for target in getattr(sub, "targets", None) or [sub.target]:
                        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                                and target.value.id == "self":
                            member(target.attr, sub, "attribute", rebinds=False)
    return out + list(members.values())


def _outline(node: ast.ClassDef, region: Region, base: int, header: tuple[int, int]) -> Outline:
    """A class's header and, for each statement of its body that binds a name, a :class:`Member`."""
    members = []
    for stmt in node.body:
        first, last = _first_line(stmt) + base, stmt.end_lineno + base
        whole = region.chars(first, last)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = stmt.body[0]
            signature = region.chars(first, max(stmt.lineno + base, _first_line(body) + base - 1))
            doc = None
            if isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) and isinstance(body.value.value, str):
                doc = region.chars(body.lineno + base, body.lineno + base)
            uses = frozenset(sub.attr for sub in ast.walk(stmt) if isinstance(sub, ast.Attribute)
                             and isinstance(sub.value, ast.Name) and sub.value.id == "self")
            members.append(Member(stmt.name, signature, doc, whole, uses))
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in getattr(stmt, "targets", None) or [stmt.target]:
                members += [Member(n, whole, None, whole) for n in _targets(target)]
    return Outline(header, tuple(members))


_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.FunctionDef,
             ast.AsyncFunctionDef, ast.ClassDef) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ()) \
    + ((ast.Match,) if hasattr(ast, "Match") else ())


def _names(nodes) -> frozenset[str]:
    return frozenset(n.id if isinstance(n, ast.Name) else n.attr for node in nodes for n in ast.walk(node)
                     if isinstance(n, (ast.Name, ast.Attribute)))


def _function_outline(node, region: Region, base: int) -> Outline:
    """A function's signature, docstring first line and statement lines (a compound statement by its
    header line(s): the condition or the loop, without its body)."""
    body = node.body[0]
    header = region.chars(_first_line(node) + base, max(node.lineno + base, _first_line(body) + base - 1))
    doc = None
    if isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) and isinstance(body.value.value, str):
        doc = region.chars(body.lineno + base, body.lineno + base)
    lines = []
    for stmt in ast.walk(node):
        if stmt is node or not isinstance(stmt, ast.stmt) or stmt is body and doc is not None:
            continue
        if isinstance(stmt, _COMPOUND):
            inner = []
            for f in ("test", "target", "iter", "items", "subject"):
                value = getattr(stmt, f, None)
                inner += value if isinstance(value, list) else [value] if value else []
            block = getattr(stmt, "body", None) or [c.pattern for c in getattr(stmt, "cases", ())]  # match: cases
            first_body = min(_first_line(b) for b in block) if block else stmt.end_lineno + 1
            last = max(stmt.lineno, first_body - 1)
            lines.append(Line(region.chars(_first_line(stmt) + base, last + base), _names(inner)))
        else:
            lines.append(Line(region.chars(stmt.lineno + base, stmt.end_lineno + base), _names([stmt]),
                              isinstance(stmt, ast.Return)))
    return Outline(header, doc=doc, lines=tuple(sorted(lines, key=lambda line: line.chars)))


def _module(tree: ast.Module, region: Region, base: int, owner: str | None = None) -> tuple[list, list]:
    """Definitions and import aliases of a parsed block whose line 1 is region line ``base + 1``."""
    defs, imports = [], []
    path = region.path
    for node in _module_statements(tree.body):
        if isinstance(node, ast.ClassDef):
            defs += _class(node, region, base, path)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs.append(Definition(node.name, owner, "function" if owner is None else "method",
                                   (region.chars(_first_line(node) + base, node.end_lineno + base),), (),
                                   _doc(node), path, _fields(node), _function_outline(node, region, base)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            span = (region.chars(node.lineno + base, node.end_lineno + base),)
            for target in getattr(node, "targets", None) or [node.target]:
                defs += [Definition(n, owner, "assignment", span, (), "", path) for n in _targets(target)]
        elif isinstance(node, ast.Import):
            imports += [(a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0])
                        for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = ("." * node.level) + (node.module or "")
            # a relative import keeps its dots: the session's index resolves it against the file's package
            imports += [(a.asname or a.name, f"{mod}.{a.name}" if mod.strip(".") else f"{mod}{a.name}")
                        for a in node.names if a.name != "*"]
    return defs, imports


def region_definitions(region: Region) -> tuple[list[Definition], list[tuple[str, str]]]:
    """Definitions and aliases of one code region: ``ast`` on the whole, else block by block (an
    indented block, cut from inside a class, is read dedented: its methods are members of an unknown
    class), else a regex for ``def``/``class``/``NAME =`` lines."""
    tree = parse_python(region.code)
    if tree is not None:
        return _module(tree, region, 0)
    defs, imports = [], []
    for first, block in _blocks(region.code):
        indented = block[:1] in (" ", "\t")
        tree = parse_python(textwrap.dedent(block) if indented else block)
        if tree is None:
            n_lines = block.count("\n") + 1
            for m in _REGEX_DEF.finditer(block):
                line = first + block.count("\n", 0, m.start())
                end = min(first + n_lines - 1, len(region.lines))
                defs.append(Definition(m.group(1) or m.group(2), None, "function",
                                       (region.chars(line, max(line, end)),), path=region.path))
            continue
        d, i = _module(tree, region, first - 1, owner="?" if indented else None)
        defs += d
        imports += i
    return defs, imports


def prose_facts(text: str, ranges) -> list[Definition]:
    """Named facts in the prose ``ranges`` of ``text`` ("`invoice_id` is the identifier")."""
    out = []
    for s, e in ranges:
        prose = text[s:e]
        for m in _FACT.finditer(prose):
            quoted, bare = m.group(1), m.group(2)
            if _NOT_FACT.match(prose, m.end()):
                continue
            name = quoted or bare
            if bare and not (shaped(bare) or (bare[0].isupper() and not sentence_start(prose, m.start())
                                              and not plain_word(bare))):
                continue
            end = prose.find("\n", m.end())
            stop = re.search(r"[.;!?](?:\s|$)", prose[m.end():end if end >= 0 else len(prose)])
            close = m.end() + stop.end() if stop else (end if end >= 0 else len(prose))
            begin = prose.rfind("\n", 0, m.start()) + 1
            out.append(Definition(name, None, "fact", ((s + begin, s + close),)))
    return out


@lru_cache(maxsize=8192)
def read(text: str) -> Reading:
    """The definitions, aliases, paths and prose of a message (cached: messages are read at every plan)."""
    regions = code_regions(text)
    defs, imports = [], []
    for region in regions:
        d, i = region_definitions(region)
        defs += d
        imports += i
    covered = sorted((r.lines[0][0], r.lines[-1][1]) for r in regions if r.lines)
    prose, at = [], 0
    for s, e in covered:
        if s > at:
            prose.append((at, s))
        at = max(at, e)
    if at < len(text):
        prose.append((at, len(text)))
    defs += prose_facts(text, prose)
    return Reading(tuple(defs), tuple(imports), tuple(dict.fromkeys(_PATH.findall(text))), tuple(prose))


# ------------------------------------------------------------------------------------------- mentions


def _code_names(code: str, out: dict[str, int], chains: set) -> None:
    """NAME tokens and dotted chains of a piece of code (a regex where ``tokenize`` fails)."""
    names = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.NAME:
                names.append(tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        names = re.findall(r"(?<![\w'\"])" + NAME, re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", " ", code))
    for n in names:
        out[n] = 2
    for m in _DOTTED.finditer(re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", " ", code)):
        chains.add(tuple(m.group().split(".")))


_DOT_NAME = re.compile(r"(?:^|(?<=[\s`(\"']))\.(" + NAME + r")(?![\w.])")
_NEXT = re.compile(r"[ \t]*([A-Za-z_][\w']*|\S?)")
_PREVIOUS = re.compile(r"([A-Za-z_][\w']*|\S?)[ \t]*$")


def _context(plain: str, start: int, end: int) -> tuple[str, str, bool, str]:
    """The word (lowercase) or punctuation right before and after ``plain[start:end]``, whether it starts
    a sentence, and what stands before the word before: "." where that word opens a sentence ("Can X be
    ...?", "Keep X stable"), else the word or punctuation there ("has tested X")."""
    previous = _PREVIOUS.search(plain, max(0, start - 40), start)
    after = _NEXT.match(plain, end).group(1)
    word = previous.group(1)
    if word and word[0].isalpha() and sentence_start(plain, previous.start(1)):
        before = "."
    else:
        before = _PREVIOUS.search(plain, max(0, previous.start(1) - 40), previous.start(1)).group(1).lower() \
            if word else ""
    return word.lower(), after.lower(), sentence_start(plain, start), before


@lru_cache(maxsize=4096)
def mentions(text: str) -> Mentions:
    """What a step or a user turn names (see the module docstring)."""
    names: dict[str, int] = {}
    chains: set[tuple[str, ...]] = set()
    if _parses_whole(text):
        _code_names(text, names, chains)
        return Mentions(names, frozenset(chains), ())
    prose = text
    for m in _FENCED.finditer(text):
        _code_names(m.group(1), names, chains)
    prose = _FENCED.sub("\n", prose).replace("`.`", ".")  # "`Reader`.`read`" is the chain `Reader.read`
    dots = set()
    for m in _INLINE.finditer(prose):
        _code_names(m.group(1), names, chains)
        dots.update(_DOT_NAME.findall(m.group(1)))
    plain = _INLINE.sub(" ", prose)
    marked = _INLINE.sub(" ` ", prose)  # the bare words' context keeps where code stood ("read `X`")
    for name in _DOT_NAME.findall(plain):  # ".put() blocks" written without backquotes
        dots.add(name)
        names[name] = 2
    bare = set()
    for m in _QUOTED.finditer(plain):
        _code_names(m.group(2), names, chains)
    for m in _WORD.finditer(plain):
        word = m.group(1)
        if "." in word:
            parts = word.split(".")
            if all(p and (shaped(p) or not plain_word(p)) for p in parts) and any(shaped(p) for p in parts):
                chains.add(tuple(parts))
            continue
        if shaped(word):
            names.setdefault(word, 2)
        elif plain.startswith("(", m.end()) or (word[0].isupper() and not sentence_start(plain, m.start())
                                                and not plain_word(word)):
            names.setdefault(word, 1)
        elif word not in names:
            bare.add(word)
    bare = [(m.group(1), *_context(marked, m.start(), m.end())) for m in _WORD.finditer(marked) if m.group(1) in bare]
    words = tuple(re.findall(r"[A-Za-z][A-Za-z0-9]*|\d+", plain))  # "http 304 not modified"
    return Mentions(names, frozenset(chains), words, frozenset(dots), tuple(bare))
