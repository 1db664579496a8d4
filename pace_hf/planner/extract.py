"""Identifiers a text mentions and defines: ``ast``/``tokenize`` for code, a small word model for prose.

The planner needs two readings of every message: which identifiers it *mentions* (to match a planned
step against earlier definitions, and a new user turn against evicted spans) and which it *defines*
(the messages a reader needs back). Both are cheap and model-free.

Code is every fenced block (any language tag) and, when the whole text parses as Python, the text
itself; inline code (single backquotes) is read as a code fragment for mentions.

* Mentions in code: every NAME token (``tokenize``; where tokenizing fails part-way, a regex over the
  rest), attribute names included, keywords excluded. String literals are not read.
* Definitions in code (``ast``): module-level ``class``/``def``/assignment targets (``X = ...``,
  ``X: T = ...``, ``X += ...``, tuple targets), also inside module-level ``if``/``try``/``with``/
  ``for``/``while`` bodies; these are the *top-level* names. Class members are a second namespace:
  annotated and assigned class attributes (dataclass fields), methods, nested classes and
  ``self.X = ...`` in methods. Names bound inside a function (parameters, locals) are not
  definitions: a local that shadows a top-level name does not redefine it.
* Imports are not definitions (they bind a name that is defined elsewhere).
* Dependencies (for the planner's closure): the free names a top-level definition uses (loads minus
  its parameters and locals) and the attribute names it uses (``record.status`` uses member
  ``status``).
* Code that does not parse (a fragment of a file cut mid-function, as pasted source often is) is
  split into column-0 blocks and each block is parsed on its own; a block that still fails gives only
  regex definitions (column-0 ``def``/``class``/``NAME =``) and no dependencies.

Prose (outside code) is read with a word model:

* mentions: backquoted code (as above), quoted identifier-shaped strings (``'fee_rate'``), and
  identifier-shaped words: ``snake_case`` (has an underscore), ``CamelCase`` (an inner capital),
  ``UPPER_CASE`` (two or more capitals), a call (``report()``) and a capitalized word that does not
  start a sentence (``an Invoice``);
* definitions ("named facts"): such a name followed by ``is``/``are``/``means``/``equals``/
  ``denotes``/``stands for``/``refers to``/``=``/``:=`` (e.g. "`invoice_id` is the identifier",
  "MAX_RETRIES = 5", "The VaultCode is 4471").

Filtered everywhere: Python keywords and builtins, ``self``/``cls``, dunders, one-character names and
a short list of English stopwords.

Limits (by design: a literal, model-free reading):

* Plain lowercase words in prose are not identifiers ("the deadline is Friday" defines nothing, and a
  step that says "the fee rule" mentions nothing); only backquoted, quoted or identifier-shaped words
  count. Synonyms, paraphrases, pronouns and "step 3" style references are not resolved.
* Names that shadow builtins (a user function called ``format``) are filtered out with the builtins.
* Identifiers are case-sensitive and matched exactly: ``fee_for`` and ``feeFor`` are different.
* Only Python is parsed; other languages' blocks fall back to the regex/tokenize reading.
* Dynamic definitions (``setattr``, ``globals()[...]``, ``exec``), star imports and re-exports are
  invisible; so are members whose class is not in the same block.
* A column-0 line inside a multi-line string can split a block wrongly; such a block falls back to
  the regex reading.
"""

from __future__ import annotations

import ast
import builtins
import io
import keyword
import re
import tokenize
from dataclasses import dataclass, field
from functools import lru_cache

STOPWORDS = frozenset("""
a an the this that these those it its it's is are was were be been being am do does did done
and or not no nor but if then else when while for of to in on at by with from as into onto over under
up down out off about above below after before again further once here there all any both each few
more most other some such only own same so than too very can will just should would could may might
must shall we you he she they them their our your his her my me us i ok yes note step steps use
now back reply write see also e.g i.e etc vs via per
""".split())
IGNORED = frozenset(keyword.kwlist) | frozenset(getattr(keyword, "softkwlist", ())) | frozenset(dir(builtins)) \
    | frozenset({"self", "cls"})

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)
_INLINE = re.compile(r"`([^`\n]+)`")
_QUOTED = re.compile(r"(?<![\w`])(['\"])(" + _NAME + r")\1(?!\w)")
_WORD = re.compile(r"(?<![\w.])(" + _NAME + r")(?![\w])")
_FACT_VERB = r"(?:is|are|means|equals|denotes|stands\s+for|refers\s+to|=|:=)"
_FACT = re.compile(r"(?:`(" + _NAME + r")`|(?<![\w.`])(" + _NAME + r")(?![\w`]))\s+" + _FACT_VERB + r"(?=\s)")
_REGEX_DEF = re.compile(r"^(?:async\s+def|def|class)\s+(" + _NAME + r")"          # def f / class C
                        r"|^(" + _NAME + r")\s*(?::[^=\n]*)?(?:[-+*/|&]?=)(?!=)", re.M)  # X = / X: T = / X +=


def keep(name: str) -> bool:
    """Whether ``name`` counts as an identifier (not a keyword, builtin, stopword, dunder or 1 char)."""
    return (len(name) > 1 and name not in IGNORED and name.lower() not in STOPWORDS
            and not (name.startswith("__") and name.endswith("__")))


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


@dataclass(frozen=True)
class Symbols:
    """What one text mentions and defines.

    ``top``: module-level names and named facts; ``members``: class members. ``uses``: for each top-level
    name, the free names its definition loads; ``attrs``: the attribute names it uses."""

    mentions: frozenset[str] = frozenset()
    top: frozenset[str] = frozenset()
    members: frozenset[str] = frozenset()
    uses: dict[str, frozenset[str]] = field(default_factory=dict)
    attrs: dict[str, frozenset[str]] = field(default_factory=dict)

    @property
    def defined(self) -> frozenset[str]:
        return self.top | self.members


# ------------------------------------------------------------------------------------------- splitting


def split_code(text: str) -> tuple[list[str], str]:
    """``(code blocks, prose)``: fenced blocks, or the whole text when it parses as Python (and is not a
    single bare word or sentence-like expression)."""
    blocks = [m.group(1) for m in _FENCE.finditer(text)]
    if blocks:
        return blocks, _FENCE.sub("\n", text)
    if _parses_as_code(text):
        return [text], ""
    return [], text


def _parses_as_code(text: str) -> bool:
    stripped = text.strip()
    if not stripped:
        return False
    try:
        tree = ast.parse(stripped)
    except (SyntaxError, ValueError):
        return False
    # A lone expression ("Noted", "fee_for") is as likely prose as code: read it as prose.
    return not all(isinstance(node, ast.Expr) for node in tree.body)


# ------------------------------------------------------------------------------------------- mentions


def code_mentions(code: str) -> set[str]:
    """NAME tokens of a piece of code (tokenize; a regex over what tokenize could not read)."""
    out: set[str] = set()
    done_line = 0
    lines = code.splitlines(keepends=True)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.NAME:
                out.add(tok.string)
            done_line = tok.end[0]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        rest = "".join(lines[done_line:])
        out.update(re.findall(r"(?<![\w'\"])" + _NAME, _strip_strings(rest)))
    return {n for n in out if keep(n)}


def _strip_strings(text: str) -> str:
    return re.sub(r"'[^'\n]*'|\"[^\"\n]*\"", " ", text)


def prose_mentions(prose: str) -> set[str]:
    """Identifiers mentioned by prose: backquoted code, quoted names and identifier-shaped words."""
    out: set[str] = set()
    for m in _INLINE.finditer(prose):
        out |= code_mentions(m.group(1))
    plain = _INLINE.sub(" ", prose)
    out |= {m.group(2) for m in _QUOTED.finditer(plain) if keep(m.group(2))}
    for m in _WORD.finditer(plain):
        word = m.group(1)
        if not keep(word):
            continue
        if shaped(word) or plain.startswith("(", m.end()) or (word[0].isupper() and not sentence_start(plain, m.start())):
            out.add(word)
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
    for node in body:
        yield node
        for attr in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)) \
                    or (hasattr(ast, "TryStar") and isinstance(node, ast.TryStar)):
                yield from _module_statements(getattr(node, attr, []) or [])
        for handler in getattr(node, "handlers", []) or []:
            yield from _module_statements(handler.body)


def _bound_names(node) -> set[str]:
    """Names bound inside a function or lambda: parameters, stores, nested defs (its locals)."""
    out: set[str] = set()
    declared_global: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = sub.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    out.add(arg.arg)
            if sub is not node and not isinstance(sub, ast.Lambda):
                out.add(sub.name)
        elif isinstance(sub, ast.ClassDef) and sub is not node:
            out.add(sub.name)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            out.add(sub.id)
        elif isinstance(sub, ast.ExceptHandler) and sub.name:
            out.add(sub.name)
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in sub.names)
        elif isinstance(sub, (ast.Global, ast.Nonlocal)):
            declared_global.update(sub.names)
    return out - declared_global


def _dependencies(node) -> tuple[set[str], set[str]]:
    """(free names loaded, attribute names used) by a top-level definition."""
    local = _bound_names(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else set()
    if isinstance(node, ast.ClassDef):  # names bound inside its methods are theirs, not the module's
        for sub in ast.walk(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                local |= _bound_names(sub)
    loads, attrs = set(), set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
            loads.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            attrs.add(sub.attr)
    return {n for n in loads - local if keep(n)}, {n for n in attrs if keep(n)}


def _class_members(node: ast.ClassDef) -> set[str]:
    out: set[str] = set()
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(stmt.name)
        elif isinstance(stmt, ast.AnnAssign):
            out.update(_targets(stmt.target))
        elif isinstance(stmt, (ast.Assign, ast.AugAssign)):
            for target in getattr(stmt, "targets", None) or [stmt.target]:
                out.update(_targets(target))
        if isinstance(stmt, ast.ClassDef):
            out |= _class_members(stmt)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    out.add(sub.attr)
    return out


def _read_module(tree: ast.Module, sym: dict) -> None:
    for node in _module_statements(tree.body):
        names: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
            if isinstance(node, ast.ClassDef):
                sym["members"] |= {n for n in _class_members(node) if keep(n)}
        elif isinstance(node, ast.Assign):
            names = [n for t in node.targets for n in _targets(t)]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            names = _targets(node.target)
        names = [n for n in names if keep(n)]
        if not names:
            continue
        loads, attrs = _dependencies(node)
        for name in names:
            sym["top"].add(name)
            sym["uses"].setdefault(name, set()).update(loads - {name})
            sym["attrs"].setdefault(name, set()).update(attrs)


def _blocks(code: str) -> list[str]:
    """Split code at column-0 statement starts (``else``/``except``/... and closers stay attached)."""
    out, current = [], []
    for line in code.splitlines(keepends=True):
        starts = line[:1] not in ("", " ", "\t", "\n", "\r", "#", ")", "]", "}") and \
            not re.match(r"(else|elif|except|finally|case)\b", line)
        if starts and current and not (current[-1].lstrip().startswith("@") and not current[-1].startswith((" ", "\t"))):
            out.append("".join(current))
            current = []
        current.append(line)
    if current:
        out.append("".join(current))
    return out


def code_definitions(code: str, sym: dict) -> None:
    """Add the definitions of one code block to ``sym`` (see the module docstring)."""
    try:
        _read_module(ast.parse(code), sym)
        return
    except (SyntaxError, ValueError, RecursionError):
        pass
    for block in _blocks(code):
        try:
            _read_module(ast.parse(block), sym)
        except (SyntaxError, ValueError, RecursionError):
            for m in _REGEX_DEF.finditer(block):
                name = m.group(1) or m.group(2)
                if keep(name):
                    sym["top"].add(name)


def prose_definitions(prose: str) -> set[str]:
    """Named facts: an identifier (backquoted or identifier-shaped) followed by is/means/equals/=."""
    out = set()
    for m in _FACT.finditer(prose):
        quoted, bare = m.group(1), m.group(2)
        if quoted and keep(quoted):
            out.add(quoted)
        elif bare and keep(bare) and (shaped(bare) or (bare[0].isupper()
                                                      and not sentence_start(prose, m.start()))):
            out.add(bare)
    return out


@lru_cache(maxsize=4096)
def read(text: str) -> Symbols:
    """Mentions and definitions of a text (cached: messages are read again at every plan)."""
    blocks, prose = split_code(text)
    sym = {"top": set(), "members": set(), "uses": {}, "attrs": {}}
    found = set()
    for block in blocks:
        found |= code_mentions(block)
        code_definitions(block, sym)
    found |= prose_mentions(prose)
    sym["top"] |= prose_definitions(prose)
    return Symbols(
        mentions=frozenset(found), top=frozenset(sym["top"]), members=frozenset(sym["members"]),
        uses={k: frozenset(v) for k, v in sym["uses"].items()},
        attrs={k: frozenset(v) for k, v in sym["attrs"].items()},
    )
