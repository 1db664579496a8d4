"""The repo suite's probes: what to ask about a renamed definition, and how to score the answer with no
model.

Three kinds, each about one definition that ``ast`` finds in a file the session printed whole:

* ``needle`` (RepoQA's *search needle function*): the function is described by its docstring's first
  sentence and its parameters, its name withheld; the answer must reproduce it. Score: RepoQA's
  similarity, smoothed sentence BLEU (nltk, ``method4``) over whitespace tokens of the code without
  comments and docstrings, against the renamed source; it passes at RepoQA's threshold, 0.8.
* ``signature``: "call ``X`` with every parameter that has a default, by keyword, at its default".
  Score: the answer's call, read with ``ast``, against the definition's parameters and defaults
  (compared as ``ast`` trees, so spacing and quote style do not matter).
* ``constant``: the value of a module-level constant, compared exactly (as ``ast`` trees).

Each score also counts *recall*: how many of the things the answer should state it states (the
renamed names of the needle's source, the defaults, the constant value's leaves), for partial credit.
"""

from __future__ import annotations

import ast
import io
import json
import re
import textwrap
import tokenize
from dataclasses import dataclass

from pace_hf.planner.extract import parse_python

KINDS = ("needle", "signature", "constant")
REPOQA_THRESHOLD = 0.8  # RepoQA's default similarity threshold for a needle to count as found
_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S)
_WORDS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Target:
    """A definition a probe asks about: its kind, qualified name (``C.m`` for a method), the file's path,
    its lines ``[first, last]`` (1-based; decorators excluded), the class header line of a method, and
    the source the answer is scored against."""

    kind: str
    qualname: str
    path: str
    first: int
    last: int
    class_line: int | None
    source: str
    node: ast.AST


def code_of(text: str) -> str:
    """The code of an answer: its first fenced block, else the whole text."""
    m = _FENCE.search(text)
    return (m.group(1) if m else text).strip("\n")


def _parse(code: str):
    return parse_python(textwrap.dedent(code))


def _without_docstrings(node: ast.AST) -> ast.AST:
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            n.body = body[1:] or [ast.Pass()]
    return node


def _strip_comments(code: str) -> str:
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type != tokenize.COMMENT]
        return tokenize.untokenize(toks)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return "\n".join(line.split("#", 1)[0] for line in code.splitlines())


def comparable(code: str, function: bool = True) -> str:
    """Code as RepoQA compares it: without comments and docstrings. When it parses, the first function it
    defines (``function``), unparsed; else the text with comments stripped."""
    tree = _parse(code)
    if tree is None:
        return _strip_comments(code)
    if function:
        fn = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
        if fn is not None:
            fn.decorator_list = []
            return ast.unparse(_without_docstrings(fn))
    return ast.unparse(_without_docstrings(tree))


def similarity(candidate: str, reference: str) -> float:
    """RepoQA's similarity: smoothed sentence BLEU (nltk's ``method4``) of the whitespace tokens."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    cand, ref = candidate.split(), reference.split()
    if not cand or not ref:
        return 0.0
    return float(sentence_bleu([ref], cand, smoothing_function=SmoothingFunction().method4))


# -- finding targets in a renamed file --------------------------------------------------------------------


def _summary(doc: str | None) -> str:
    """The docstring's first sentence (its first paragraph, cut at the first period), one line."""
    if not doc:
        return ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    cut = re.search(r"(?<=[.!?])\s", para)
    return para[:cut.start()] if cut else para


def _defaults(args: ast.arguments) -> list[tuple[str, ast.expr]]:
    """(parameter, default) of every parameter with a default, in order."""
    positional = [*args.posonlyargs, *args.args]
    out = [(a.arg, d) for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults)]
    out += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    return out


def _constant_like(node: ast.Assign) -> bool:
    """A module-level constant: an UPPER_CASE name, or a literal value."""
    if node.targets[0].id.strip("_").isupper():
        return True
    try:
        ast.literal_eval(node.value)
        return True
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


def _bound_once(tree: ast.Module) -> set[str]:
    """The names that the module binds exactly once, at any depth outside classes and functions (an
    assignment, a def or class, an import)."""
    count: dict[str, int] = {}

    def bind(name):
        count[name] = count.get(name, 0) + 1

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bind(child.name)
                continue
            if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                bind(child.id)
            elif isinstance(child, ast.alias):
                bind(child.asname or child.name.split(".")[0])
            visit(child)

    visit(tree)
    return {name for name, n in count.items() if n == 1}


def targets_in(source: str, path: str, renamed: set[str]) -> list[Target]:
    """Every definition of ``source`` (a renamed file) that a probe can ask about; ``renamed``: the
    names the renaming replaced (only those are asked about, so pretraining cannot answer)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out = []
    once = _bound_once(tree)  # a module-level name bound twice (try/except, if/else) has no one answer

    def src(first, last):
        return textwrap.dedent("\n".join(lines[first - 1:last]))

    def functions(body, owner):
        for node in body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name not in renamed:
                continue
            if owner is None and node.name not in once:
                continue
            qual = f"{owner.name}.{node.name}" if owner else node.name
            first, last = node.lineno, node.end_lineno
            text = src(first, last)
            cls_line = owner.lineno if owner else None
            summary = _summary(ast.get_docstring(node))
            if (len(summary.split()) >= 4 and 4 <= last - first <= 40 and len(text) <= 1600
                    and node.name not in summary):
                out.append(Target("needle", qual, path, first, last, cls_line, text, node))
            defaults = _defaults(node.args)
            if (len(defaults) >= 2 and all(len(ast.unparse(d)) <= 40 for _, d in defaults)
                    and not node.args.posonlyargs):
                out.append(Target("signature", qual, path, node.lineno, last, cls_line, text, node))

    functions(tree.body, None)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in renamed:
            functions(node.body, node)
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in renamed and node.targets[0].id in once and node.lineno == node.end_lineno
                and isinstance(node.value, (ast.Constant, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.BinOp,
                                            ast.UnaryOp, ast.Call))
                and 3 <= len(ast.unparse(node.value)) <= 100 and _constant_like(node)):
            out.append(Target("constant", node.targets[0].id, path, node.lineno, node.lineno, None,
                              lines[node.lineno - 1], node))
    return out


# -- the probes ----------------------------------------------------------------------------------------------

_BLOCK = "Reply with one ```python block only, no explanation."


def probe_for(t: Target, token_count) -> dict:
    """The probe's prompt, answer prefix, answer budget and grading reference (JSON) for target ``t``;
    ``token_count(text)`` counts tokens with the session's tokenizer."""
    node = t.node
    if t.kind == "needle":
        what = "method" if t.class_line else "function"
        params = ast.unparse(node.args)
        prompt = (f"Earlier in this session you read a {what} whose docstring begins \"{_summary(ast.get_docstring(node))}\" "
                  f"and whose parameters are ({params}). Its name is withheld. Reproduce that {what} exactly as it is "
                  f"written in the file, from its def line to its last line. {_BLOCK}")
        reference = {"kind": "needle", "source": t.source, "names": sorted(_names_in(t)),
                     "threshold": REPOQA_THRESHOLD}
        prefix, budget = "```python\n", min(640, token_count(t.source) + 48)
    elif t.kind == "signature":
        defaults = _defaults(node.args)
        prompt = (f"Write one call of `{t.qualname}` that passes every parameter that has a default value by "
                  "keyword, set to its default exactly as the definition writes it (leave out `self`, `cls` and the "
                  f"parameters without a default). {_BLOCK}")
        reference = {"kind": "signature", "callee": t.qualname.split(".")[-1],
                     "defaults": {name: ast.unparse(d) for name, d in defaults}}
        prefix = ""
        budget = min(320, 48 + token_count(t.qualname) + sum(token_count(f"{n}={ast.unparse(d)}, ") for n, d in defaults))
    elif t.kind == "constant":
        prompt = (f"Quote the line of `{t.path}` that assigns the module-level constant `{t.qualname}`, exactly as the "
                  f"file writes it. {_BLOCK}")
        reference = {"kind": "constant", "name": t.qualname, "value": ast.unparse(node.value)}
        prefix, budget = "", min(200, token_count(t.source) + 48)
    else:
        raise ValueError(f"unknown probe kind {t.kind!r}; kinds: {', '.join(KINDS)}")
    return {"kind": t.kind, "target": t.qualname, "path": t.path, "prompt": prompt, "answer_prefix": prefix,
            "max_new_tokens": int(budget), "reference": json.dumps(reference)}


def _names_in(t: Target) -> set[str]:
    """The names a reproduced needle should write: the def's own name and its parameters."""
    node = t.node
    a = node.args
    return {node.name, *(x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x)} - {"self", "cls"}


# -- scoring -------------------------------------------------------------------------------------------------


def _leaves(expr: ast.AST) -> list[str]:
    return [ast.dump(n) for n in ast.walk(expr) if isinstance(n, (ast.Constant, ast.Name, ast.Attribute))]


def _signature_defaults(code: str, callee: str) -> dict[str, str] | None:
    """The parameters with defaults (as ``ast.dump`` of the default) of ``callee(...)`` written as a
    signature in ``code``, or None when there is none that parses."""
    at = re.search(rf"\b{re.escape(callee)}\s*\(", code)
    if at is None:
        return None
    depth, start = 0, at.end() - 1
    for i in range(start, len(code)):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            tree = _parse(f"def {callee}{code[start:i + 1]}: pass")
            if tree is None:
                return None
            return {name: ast.dump(d) for name, d in _defaults(tree.body[0].args) if name not in ("self", "cls")}
    return None


def score(answer: str, reference: str | dict, answer_prefix: str = "") -> dict:
    """Score one answer (the generated text; ``answer_prefix``, given in the prompt, is put before it):
    ``passed``, ``recall_hits`` / ``recall_total``, ``failure`` (why it failed, or None) and, for a
    needle, ``similarity``."""
    ref = json.loads(reference) if isinstance(reference, str) else reference
    code = code_of(answer_prefix + answer)
    kind = ref["kind"]
    if kind == "needle":
        sim = similarity(comparable(code), comparable(ref["source"]))
        said = set(_WORDS.findall(code))
        hits = sum(n in said for n in ref["names"])
        passed = sim >= ref["threshold"]
        return {"passed": passed, "similarity": round(sim, 4), "recall_hits": hits, "recall_total": len(ref["names"]),
                "failure": None if passed else f"similarity {sim:.2f} < {ref['threshold']}"}
    if kind == "signature":
        want = {k: ast.dump(ast.parse(v, mode="eval").body) for k, v in ref["defaults"].items()}
        tree = _parse(code)
        call = None if tree is None else next(
            (n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and ast.unparse(n.func).split(".")[-1] == ref["callee"]), None)
        if call is not None:
            got, positional = {k.arg: ast.dump(k.value) for k in call.keywords if k.arg}, bool(call.args)
        else:  # a signature written out instead of a call ("f(a: int = 1, b=2)") states the same defaults
            got, positional = _signature_defaults(code, ref["callee"]), False
        if got is None:
            return {"passed": False, "recall_hits": 0, "recall_total": len(want),
                    "failure": "no call of " + ref["callee"] if tree is not None else "does not parse"}
        hits = sum(got.get(k) == v for k, v in want.items())
        passed = got == want and not positional
        why = None
        if not passed:
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            wrong = sorted(k for k in want if k in got and got[k] != want[k])
            why = "; ".join(f"{label}: {', '.join(v)}" for label, v in
                            (("missing", missing), ("not a parameter with a default", extra), ("wrong default", wrong),
                             ("positional arguments", ["given"] if positional else [])) if v)
        return {"passed": passed, "recall_hits": hits, "recall_total": len(want), "failure": why}
    if kind == "constant":
        want = ast.parse(ref["value"], mode="eval").body
        tree = _parse(code)
        value = None if tree is None else next(
            (n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == ref["name"] for t in n.targets)), None)
        leaves = _leaves(want)
        if value is None:
            return {"passed": False, "recall_hits": 0, "recall_total": len(leaves),
                    "failure": "does not parse" if tree is None else f"no assignment to {ref['name']}"}
        said = _leaves(value)
        hits = sum(min(leaves.count(x), said.count(x)) for x in set(leaves))
        passed = ast.dump(value) == ast.dump(want)
        return {"passed": passed, "recall_hits": hits, "recall_total": len(leaves),
                "failure": None if passed else "wrong value"}
    raise ValueError(f"unknown probe kind {kind!r}; kinds: {', '.join(KINDS)}")
