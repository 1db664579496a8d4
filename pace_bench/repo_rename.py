"""Consistent renaming of the identifiers a set of source files defines, so that a model cannot answer
a probe about them from what it saw in pretraining.

Which names: those the files *define*, read with ``ast``: functions, classes, methods, parameters and
the targets of module- and class-level assignments. Never renamed: dunders, keywords, builtins, the
attributes of builtin types (``items``, ``append``: a rename there would make ``dict`` calls look
like session code) and every name bound by an import from outside the files' package (``os``,
``Path``). Each name gets one seeded, pronounceable replacement of the same shape (``parse_version``
-> ``kobe_marita``, ``HTTPError`` -> ``Zovamu``, ``MAX_SIZE`` -> ``DUNI_LOKA``), used everywhere in
every file, so the renamed files still agree with each other.

How: over ``tokenize`` tokens, not ``ast.unparse``, so comments and layout stay as written. A NAME token
is replaced when it is a renamed name; in strings and comments, backquoted names, the names of
``:param x:`` fields and names shaped like code (with an inner ``_`` or a capital) are replaced too, and inside an f-string's replacement fields
every renamed name is. A renamed file is kept only when it compiles (:meth:`Renaming.apply` raises
``SyntaxError`` otherwise).
"""

from __future__ import annotations

import ast
import builtins
import io
import keyword
import random
import re
import tokenize
from dataclasses import dataclass, field

KEEP = (set(dir(builtins)) | set(keyword.kwlist) | set(getattr(keyword, "softkwlist", ())) | {"self", "cls"}
        | {a for t in (object, dict, list, str, set, tuple, int, float, bytes, Exception, type) for a in dir(t)})
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BACKQUOTED = re.compile(r"`+([A-Za-z_][\w.]*)`+")
_FIELD = re.compile(r"\{[^{}]*\}")
_FIELD_DOC = re.compile(r"(:(?:param|type|keyword|ivar|cvar|var)(?:\s+[\w.\[\]|, ]+?)?\s+)(\w+)(:)")  # :param str url:


def defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines: functions, classes and methods, parameters, and the Name targets of
    module- and class-level assignments (not locals)."""
    out: set[str] = set()

    def targets(body):
        for node in body:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.If, ast.Try)):  # if TYPE_CHECKING:, try: ... except ImportError:
                targets(node.body)
                targets(getattr(node, "orelse", []))

    targets(getattr(tree, "body", []))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, ast.ClassDef):
            targets(node.body)
        if isinstance(node, ast.arguments):
            out.update(a.arg for a in (*node.posonlyargs, *node.args, *node.kwonlyargs, node.vararg, node.kwarg) if a)
    return out


def imported_names(tree: ast.AST, package: str) -> set[str]:
    """Names bound by imports from outside ``package`` (absolute imports of other distributions)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != package:
                    out.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] != package:
            out.update(a.asname or a.name for a in node.names)
    return out


def _shape(name: str) -> tuple[str, int, str]:
    """(leading underscores, number of words, case: 'snake' | 'camel' | 'upper')."""
    core = name.lstrip("_")
    lead = name[:len(name) - len(core)]
    if core.isupper() or (core.upper() == core and any(c.isalpha() for c in core)):
        return lead, max(1, len([p for p in core.split("_") if p])), "upper"
    if "_" in core or core[:1].islower():
        return lead, max(1, len([p for p in core.split("_") if p])), "snake"
    return lead, max(1, len(re.findall(r"[A-Z][a-z0-9]*", core))), "camel"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.choice((2, 2, 3))))


def _pronounceable(name: str, rng: random.Random) -> str:
    lead, words, case = _shape(name)
    parts = [_word(rng) for _ in range(min(words, 3))]
    if case == "upper":
        return lead + "_".join(p.upper() for p in parts)
    if case == "camel":
        return lead + "".join(p.capitalize() for p in parts)
    return lead + "_".join(parts)


def code_shaped(name: str) -> bool:
    """A name that prose would not write as a plain word: an inner underscore or a capital letter."""
    return "_" in name.strip("_") or any(c.isupper() for c in name)


@dataclass
class Renaming:
    """One session's mapping ``{original: replacement}``; :meth:`apply` renames a file with it."""

    mapping: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_sources(cls, sources: list[str], package: str, seed) -> "Renaming":
        """The mapping for the files ``sources`` (those that parse) of ``package``, seeded by ``seed``.
        Replacements never collide with each other or with any word the files already hold."""
        defined, kept, taken = set(), set(KEEP), set()
        for src in sources:
            tree = ast.parse(src)
            defined |= defined_names(tree)
            kept |= imported_names(tree, package)
            taken.update(_WORD.findall(src))
        rng = random.Random(f"repo-rename:{seed}")
        mapping: dict[str, str] = {}
        for name in sorted(defined - kept):
            if name.startswith("__") and name.endswith("__"):
                continue
            new = _pronounceable(name, rng)
            while new in taken or keyword.iskeyword(new) or new in KEEP:
                new = _pronounceable(name, rng)
            taken.add(new)
            mapping[name] = new
        return cls(mapping)

    def name(self, original: str) -> str:
        """The replacement of ``original`` (itself when it is not renamed); dotted names part by part."""
        return ".".join(self.mapping.get(p, p) for p in original.split("."))

    def _words(self, text: str, every: bool) -> str:
        def one(m):
            w = m.group(0)
            return self.mapping[w] if w in self.mapping and (every or code_shaped(w)) else w

        text = _BACKQUOTED.sub(lambda m: m.group(0).replace(m.group(1), self.name(m.group(1))), text)
        text = _FIELD_DOC.sub(lambda m: m.group(1) + self.mapping.get(m.group(2), m.group(2)) + m.group(3), text)
        return _WORD.sub(one, text)

    def _field(self, field: str) -> str:
        """An f-string replacement field: every renamed name of its expression, not of its ``!r`` or
        format spec."""
        depth, cut = 0, len(field) - 1
        for i, c in enumerate(field[1:-1], 1):
            depth += c in "([{"
            depth -= c in ")]}"
            if depth == 0 and (c == ":" or (c == "!" and field[i + 1:i + 2] != "=")):
                cut = i
                break
        return "{" + self._words(field[1:cut], every=True) + field[cut:]

    def words(self, text: str) -> str:
        """Text that does not parse, renamed word by word (every renamed name, wherever it stands)."""
        return _WORD.sub(lambda m: self.mapping.get(m.group(0), m.group(0)), text)

    def text(self, text: str) -> str:
        """Prose (a docstring's sentence, a remark) with its backquoted and code-shaped names renamed."""
        return self._words(text, every=False)

    def apply(self, source: str, filename: str = "<renamed>") -> str:
        """``source`` renamed; raises ``SyntaxError`` when the result does not compile."""
        lines = source.splitlines(keepends=True)
        starts = [0]
        for line in lines:
            starts.append(starts[-1] + len(line))
        edits = []
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            kind, s = tok.type, tok.string
            if kind == tokenize.NAME:
                new = self.mapping.get(s, s)
            elif kind == tokenize.STRING:
                prefix = s[:len(s) - len(s.lstrip("rRbBuUfF"))]
                new = self._words(s, every=False)
                if "f" in prefix.lower():
                    new = _FIELD.sub(lambda m: self._field(m.group(0)), new)
            elif kind == tokenize.COMMENT:
                new = self._words(s, every=False)
            else:
                continue
            if new != s:
                (r0, c0), (r1, c1) = tok.start, tok.end
                edits.append((starts[r0 - 1] + c0, starts[r1 - 1] + c1, new))
        out = source
        for a, b, new in reversed(edits):
            out = out[:a] + new + out[b:]
        compile(out, filename, "exec", dont_inherit=True)
        return out
