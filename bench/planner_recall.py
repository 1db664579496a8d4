"""Recall, precision and plan size of ``SymbolPlanner`` on agent-like sessions over real source files.

Why: the planner must find, from the session's text alone, the definitions a planned step needs, and
plan little more than those (a plan larger than the cache's budget cannot be kept). Nobody here wrote
the code it reads: the sessions are built from the installed packages' and the standard library's
source files.

``--corpus real`` (default). A session is a task, then tool calls that print whole files (``cat``; for
the line-numbered style ``cat -n``, ``nl -ba``, ``   12→`` and ``12:`` listings) with short assistant
turns (some of them remarks that name definitions), then 3-6 planned steps. Each step needs one or
two definitions, chosen from the session's files; ground truth comes from ``ast`` (the node's lines,
decorators included). Plan styles:

* ``literal``: backquoted identifiers (``Class.method`` for a method, ``name`` otherwise);
* ``line-numbered``: the same plans over line-numbered listings;
* ``prose``: names as words ("the version parser", "parse version", ``parseVersion``), or, for a
  quarter of the steps, only the first sentence of the docstring;
* ``indirect``: a method without its class, an inherited member through its subclass
  (``Sub.method`` where a base defines it), a name through its module (``utils.quote``) or an import
  alias that a session file binds;
* ``description``: only the first sentence of the docstring (five words or more), as a RepoQA needle
  describes a function without its name: the lexical ranker alone must find it.

A definition is found when at least 90% of its tokens are planned for the step that needs it.
Precision is token-level: the share of a step's planned tokens that lie in a definition the step needs.
Plan tokens are those planned for a step; the budget check is plan tokens <= budget // 2.

Split: ``dev`` packages and wordings (used while building the planner) and ``held-out`` packages and
wordings (never looked at while tuning). Report both.

``--corpus synthetic`` runs the earlier edge-level measure on the generated coding sessions.

    python bench/planner_recall.py [--split dev,held-out] [--sessions 12] [--tokens 48000] [--json out.json]
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from pace_bench.models import load_tokenizer
from pace_hf.chat import ChatTemplate
from pace_hf.planner import SymbolPlanner, read
from pace_hf.planner.prose import split_name
from pace_hf.session import Message

STYLES = ("literal", "line-numbered", "prose", "indirect", "description")
CORPUS = {  # (packages, standard library modules)
    "dev": (["requests", "click", "jinja2", "rich", "urllib3", "yaml", "packaging"],
            ["json", "email", "http", "argparse", "dataclasses", "textwrap", "csv", "ast", "pathlib"]),
    "held-out": (["tqdm", "markdown_it", "starlette", "datasets", "evaluate", "accelerate", "typer", "attr"],
                 ["logging", "concurrent", "xml", "asyncio", "configparser", "shutil", "tarfile", "zipfile"]),
}
WORDINGS = {
    "dev": {
        "literal": ["Change {ref} so that it logs its arguments.", "Write a unit test for {ref}.",
                    "Explain what {ref} returns on an empty input."],
        "prose": ["Fix how {words} handles empty input.", "Add type hints to the {words}.",
                  "Document the {words} better."],
        "docstring": ["Find the code that does this and add a test: {doc}", "Where is the code for this? {doc}",
                      "Something here should do this: {doc} Check that it does."],
        "indirect": ["Write a test that calls {ref}.", "Explain the edge cases of {ref}."],
    },
    "held-out": {
        "literal": ["Next, read {ref} and tell me whether it can raise.", "Refactor {ref} for clarity.",
                    "I want {ref} to accept a timeout; propose a patch."],
        "prose": ["The {words} looks wrong to me; review it.", "Can you speed up {words}?",
                  "Please rewrite {words} without recursion."],
        "docstring": ["There is something that does this: {doc} Review it."],
        "indirect": ["Review {ref} for thread safety.", "Make {ref} faster."],
    },
}
TASKS = ["Task: get to know this code base, then follow the plan.", "Task: we will make a few changes here."]
REMARKS = ["`{name}` is defined in `{path}`.", "OK, `{name}` is the entry point here.", "Noted `{name}`."]


@dataclass
class Target:
    """A definition a step needs: where its source lies (file index, 1-based lines) and its names."""

    file: int
    first: int
    last: int
    name: str
    owner: str | None
    kind: str
    doc: str


# ------------------------------------------------------------------------------------------- corpus


def source_files(split: str, min_chars=1500, max_chars=40000) -> list[tuple[str, str]]:
    """``(relative path, text)`` of the split's source files that parse."""
    packages, stdlib = CORPUS[split]
    roots = []
    for name in packages:
        spec = __import__("importlib.util").util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"package {name!r} is not installed: its source is needed for the corpus")
        roots.append(Path(list(spec.submodule_search_locations)[0]))
    lib = Path(sysconfig.get_paths()["stdlib"])
    for name in stdlib:
        roots.append(lib / name if (lib / name).is_dir() else lib / f"{name}.py")
    out = []
    for root in roots:
        for path in sorted([root] if root.is_file() else root.rglob("*.py")):
            if "test" in path.parts[-2:] or path.name.startswith("test"):
                continue
            try:
                text = path.read_text(encoding="utf-8")
                ast.parse(text)
            except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
                continue  # a file that does not read or parse is left out, never a crash
            if min_chars <= len(text) <= max_chars:
                out.append((str(path.relative_to(root.parent)), text))
    return out


def targets_of(text: str, file: int) -> list[Target]:
    """Candidate needs in one file: functions, methods, module constants and small classes."""
    out = []
    for node in ast.parse(text).body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.append(Target(file, first, node.end_lineno, node.name, None, "function", ast.get_docstring(node) or ""))
        elif isinstance(node, ast.ClassDef):
            if node.end_lineno - first < 40:
                out.append(Target(file, first, node.end_lineno, node.name, None, "class", ast.get_docstring(node) or ""))
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("__"):
                    f = min([sub.lineno] + [d.lineno for d in sub.decorator_list])
                    out.append(Target(file, f, sub.end_lineno, sub.name, node.name, "method", ast.get_docstring(sub) or ""))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(t, ast.Name)]
            if len(names) == 1 and names[0].isupper() and len(names[0]) > 3:
                out.append(Target(file, node.lineno, node.end_lineno, names[0], None, "constant", ""))
    return [t for t in out if t.last - t.first < 80]


def listing(text: str, style: str, rng) -> tuple[str, str, list[int]]:
    """``(command, output, start character of each source line)`` of a file printed by a tool."""
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    if style != "line-numbered":
        starts, at = [], 0
        for line in lines:
            starts.append(at)
            at += len(line) + 1
        return "cat", text, starts
    form = rng.choice(["cat -n", "nl -ba", "read", "colon"])
    out, starts = [], []
    at = 0
    for n, line in enumerate(lines, 1):
        prefix = {"cat -n": f"{n:6d}\t", "nl -ba": f"{n:6d}\t", "read": f"{n:6d}→", "colon": f"{n}:"}[form]
        starts.append(at + len(prefix))
        out.append(prefix + line)
        at += len(prefix) + len(line) + 1
    return {"read": "read", "colon": "view"}.get(form, form), "\n".join(out) + "\n", starts


def build_session(files, split, style, rng, tokens, template, n_steps) -> dict:
    """One session: messages with exact token spans, the plan, and each step's needed token spans."""
    messages, ids_len = [], len(template.system_ids)
    printed = []  # (file index, message position, line starts)

    def add(role, content, step):
        nonlocal ids_len
        n = len(template.encode(template.block(role, content)))
        messages.append(Message(len(messages), role, content, ids_len, ids_len + n, step))
        ids_len += n

    add("user", rng.choice(TASKS), 1)
    order = rng.sample(range(len(files)), len(files))
    for fi in order:
        if ids_len >= tokens:
            break
        path, text = files[fi]
        command, output, starts = listing(text, style, rng)
        add("assistant", f"I'll read `{path}`.\n$ {command} {path}", 1)
        printed.append((fi, len(messages), starts))
        add("tool", output, 1)
        if rng.random() < 0.3:
            defs = [d for d in read(text).definitions if d.owner is None and d.kind != "fact"]
            if defs:
                add("assistant", rng.choice(REMARKS).format(name=rng.choice(defs).name, path=path), 1)
    # ground truth: every definition, which one is the latest of its name, and its tokens
    by_name: dict[tuple, list] = {}
    pool = []
    for fi, pos, starts in printed:
        for t in targets_of(files[fi][1], fi):
            key = (t.owner, t.name)
            by_name.setdefault(key, []).append((pos, t, starts))
            pool.append(key)
    # a bare name is ambiguous when another printed file also defines it at top level
    top_count = {}
    for (owner, name), where in by_name.items():
        if owner is None:
            top_count[name] = top_count.get(name, 0) + len(where)
    member_count = {}  # every member binding counts, self.X attributes too
    for fi, _, _ in printed:
        for d in read(files[fi][1]).definitions:
            if d.owner is not None:
                member_count[d.name] = member_count.get(d.name, 0) + 1
    wordings = WORDINGS[split]
    steps, needs = {}, {}
    rng.shuffle(pool)
    used = set()
    for step in range(2, 2 + n_steps):
        for _ in range(200):
            if not pool:
                break
            key = pool.pop()
            if key in used:
                continue
            pos, target, starts = by_name[key][-1]  # the latest definition of it
            text = plan_text(style, target, files[target.file][0], wordings, rng, top_count, member_count,
                             files, by_name)
            if text is None:
                continue
            used.add(key)
            msg = messages[pos]
            lines = files[target.file][1].split("\n")
            a = starts[target.first - 1]
            b = starts[target.last - 1] + len(lines[target.last - 1])
            offsets, _, at = template.content_offsets(msg.role, msg.content)
            got = offsets.span(a + at, b + at)
            needs[step] = [(msg.start + got[0], msg.start + got[1])]
            steps[step] = text
            break
    return {"messages": messages, "steps": steps, "needs": needs, "tokens": ids_len}


def _first_sentence(doc: str) -> str:
    return doc.strip().split("\n\n")[0].replace("\n", " ").split(". ")[0].strip().rstrip(".")


def plan_text(style, t: Target, path, wordings, rng, top_count, member_count, files, by_name) -> str | None:
    """The step's words for target ``t`` in ``style`` (None when ``t`` does not suit the style)."""
    if style == "description":
        first_sentence = _first_sentence(t.doc)
        if len(first_sentence.split()) < 5 or t.kind == "constant":
            return None
        return rng.choice(wordings["docstring"]).format(doc=first_sentence + ".")
    if style in ("literal", "line-numbered"):
        if t.owner is None and top_count.get(t.name, 0) > 1:
            ref = f"`{Path(path).stem}.{t.name}`"
        else:
            ref = f"`{t.owner}.{t.name}`" if t.owner else f"`{t.name}`"
        return rng.choice(wordings["literal"]).format(ref=ref)
    if style == "prose":
        if t.owner is None and top_count.get(t.name, 0) > 1 or (t.owner and member_count.get(t.name, 0) > 1):
            return None
        first_sentence = _first_sentence(t.doc)
        if rng.random() < 0.25 and len(first_sentence.split()) >= 5:
            return rng.choice(wordings["docstring"]).format(doc=first_sentence + ".")
        words = split_name(t.name)
        if not words:
            return None
        form = rng.choice(["spaced", "spaced", "camel"] if "_" in t.name else ["spaced"])
        phrase = (words[0] + "".join(w.capitalize() for w in words[1:])) if form == "camel" else " ".join(words)
        kind = {"function": "function", "method": "method", "class": "class", "constant": "constant"}[t.kind]
        if t.owner:
            phrase = f"{phrase} method of the {' '.join(split_name(t.owner))}"
        elif len(words) == 1 or rng.random() < 0.5:
            phrase = f"{phrase} {kind}"
        return rng.choice(wordings["prose"]).format(words=phrase)
    # indirect
    if t.owner is not None:
        subclasses = [name for (owner, name), where in by_name.items() if owner is None
                      and any(w[1].kind == "class" for w in where)]
        for sub in subclasses:  # a subclass in the session that inherits this method
            src = files[by_name[(None, sub)][-1][1].file][1]
            node = next((n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == sub), None)
            if node and t.owner in {getattr(b, "id", getattr(b, "attr", None)) for b in node.bases} and \
                    (sub, t.name) not in by_name:
                return rng.choice(wordings["indirect"]).format(ref=f"`{sub}.{t.name}`")
        if member_count.get(t.name, 0) == 1 and top_count.get(t.name, 0) == 0:
            return rng.choice(wordings["indirect"]).format(ref=f"`{t.name}`")
        return None
    if t.kind in ("function", "constant"):
        module = Path(path).stem if Path(path).stem != "__init__" else Path(path).parent.name
        return rng.choice(wordings["indirect"]).format(ref=f"`{module}.{t.name}`")
    return None


# ------------------------------------------------------------------------------------------- scoring


def overlap(a: tuple[int, int], spans) -> int:
    return sum(max(0, min(a[1], e) - max(a[0], s)) for s, e in spans)


def score_session(session, planner, budget) -> list[dict]:
    """Per step: found definitions, needed, planned and correct tokens."""
    plan = planner.blueprint_for(session["messages"], session["steps"], template=session["template"],
                                 budget=budget, now=1)
    rows = []
    for step, need in session["needs"].items():
        planned = sorted((s.start, s.end) for s in plan if step in s.readers)
        planned_tokens = sum(e - s for s, e in planned)
        needed = sum(e - s for s, e in need)
        found = sum(overlap(n, planned) >= 0.9 * (n[1] - n[0]) for n in need)
        correct = sum(overlap(p, need) for p in planned)
        rows.append({"step": step, "needs": len(need), "found": found, "needed_tokens": needed,
                     "planned_tokens": planned_tokens, "correct_tokens": correct,
                     "dropped": sum(1 for d in plan.dropped if d.step == step)})
    return rows


def summarize(rows, budget) -> dict:
    needs = sum(r["needs"] for r in rows)
    planned = sum(r["planned_tokens"] for r in rows)
    ratios = [r["planned_tokens"] / r["needed_tokens"] for r in rows if r["needed_tokens"]]
    return {
        "steps": len(rows), "recall": sum(r["found"] for r in rows) / max(1, needs),
        "precision": sum(r["correct_tokens"] for r in rows) / max(1, planned),
        "plan_tokens_median": statistics.median(r["planned_tokens"] for r in rows) if rows else 0,
        "needed_tokens_median": statistics.median(r["needed_tokens"] for r in rows) if rows else 0,
        "planned_over_needed_median": statistics.median(ratios) if ratios else 0,
        "within_half_budget": sum(r["planned_tokens"] <= budget // 2 for r in rows) / max(1, len(rows)),
        "dropped": sum(r["dropped"] for r in rows),
    }


def run_real(args) -> dict:
    tokenizer = load_tokenizer(args.tokenizer)
    template = ChatTemplate(tokenizer)
    results = {}
    for split in args.split.split(","):
        files = source_files(split)
        results[split] = {}
        for style in STYLES:
            rng = random.Random(f"{args.seed}-{split}-{style}")
            rows, misses, tokens = [], [], []
            t0 = time.perf_counter()
            for k in range(args.sessions):
                session = build_session(files, split, style, rng, args.tokens, template, rng.randint(3, 6))
                session["template"] = template
                tokens.append(session["tokens"])
                got = score_session(session, SymbolPlanner(depth=args.depth), args.budget)
                rows += got
                misses += [{"session": k, "step": r["step"], "plan": session["steps"][r["step"]]}
                           for r in got if r["found"] < r["needs"]]
            res = summarize(rows, args.budget)
            res.update(sessions=args.sessions, session_tokens_median=statistics.median(tokens),
                       files=len(files), seconds=round(time.perf_counter() - t0, 1), misses=misses)
            results[split][style] = res
            print(f"{split:<9}{style:<14}{res['recall']:>7.3f}{res['precision']:>10.3f}"
                  f"{res['plan_tokens_median']:>10.0f}{res['needed_tokens_median']:>9.0f}"
                  f"{res['planned_over_needed_median']:>8.2f}{res['within_half_budget']:>8.2f}"
                  f"{res['steps']:>7}{res['seconds']:>7}", flush=True)
    return results


# ------------------------------------------------------------------------------------------- synthetic


def run_synthetic(args) -> dict:
    """Edge recall/precision against the oracle blueprints of the generated coding sessions."""
    from pace_bench import load_sessions, session_messages
    tokenizer = load_tokenizer(args.tokenizer)
    template = ChatTemplate(tokenizer)
    rows = load_sessions(tokenizer, n_sessions=args.sessions, total_tokens=args.tokens, seed=args.seed)
    hit = truth_n = correct = edges_n = 0
    for row in rows:
        messages = session_messages(row, tokenizer)
        steps = {p["step"]: p["prompt"] for p in row["probes"]}
        plan = SymbolPlanner(depth=args.depth).blueprint_for(messages, steps, template=template)
        edges = {(s.start, s.end, r) for s in plan for r in s.readers}
        truth = [(o["start"], o["end"], r) for o in row["blueprint"] for r in o["readers"]]
        hit += sum(any(r == s and o0 < p1 and p0 < o1 for p0, p1, s in edges) for o0, o1, r in truth)
        correct += sum(any(r == s and o0 < p1 and p0 < o1 for o0, o1, r in truth) for p0, p1, s in edges)
        truth_n, edges_n = truth_n + len(truth), edges_n + len(edges)
    out = {"recall": hit / max(1, truth_n), "precision": correct / max(1, edges_n), "oracle_edges": truth_n}
    print(f"synthetic seed {args.seed}: recall {out['recall']:.3f} precision {out['precision']:.3f} "
          f"({truth_n} oracle edges)")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", choices=["real", "synthetic"], default="real")
    ap.add_argument("--split", default="dev,held-out", help="dev, held-out or both (comma-separated)")
    ap.add_argument("--sessions", type=int, default=12, help="sessions per split and style")
    ap.add_argument("--tokens", type=int, default=48000, help="tokens of tool output per session (about)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", default="smollm2-135m")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    if args.corpus == "synthetic":
        results = run_synthetic(args)
    else:
        print(f"{'split':<9}{'style':<14}{'recall':>7}{'precision':>10}{'plan':>10}{'needed':>9}"
              f"{'ratio':>8}{'<=B/2':>8}{'steps':>7}{'s':>7}")
        results = run_real(args)
    results = {"args": vars(args), "results": results, "seconds": round(time.perf_counter() - started, 1)}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"total {results['seconds']} s", file=sys.stderr)


if __name__ == "__main__":
    main()
