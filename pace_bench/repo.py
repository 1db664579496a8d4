"""The repo suite's sessions: an agent reading the real source of an installed package, then probes.

Nobody here wrote the code these sessions hold: each session is one package's Python source as the
environment installed it (``importlib.util.find_spec``). Its layout:

==========  ====================================================================
part        content
==========  ====================================================================
task        one user turn (step 0): the task, in that package's repository
reading     tool calls, each a short assistant turn naming the command and the
            tool's output: ``cat`` or ``cat -n`` (or the ``   12→`` form agent
            read-tools print) of a whole file, sometimes after a ``grep -n`` of its
            definitions, sometimes with a remark naming a definition; a file too
            long for the room left is shown as its ``head -n K``
probes      one user turn each, after the reading (steps 1, 2, ...): ``needle``,
            ``signature`` and ``constant`` probes (:mod:`pace_bench.repo_probes`)
==========  ====================================================================

Every identifier the files define is renamed (:mod:`pace_bench.repo_rename`) before the session is
built, consistently across the files, so that the model cannot answer from pretraining; the renamed
files compile. A file that does not parse (or is not UTF-8) is still read, as text, renamed word by
word; no probe is drawn from it. ``listing`` picks how files are printed: ``mixed`` (each file
``cat``, ``cat -n`` or ``→``, seeded), ``cat`` or ``cat-n``.

The oracle blueprint plans, for each probe, the tokens of its target definition (a method with its
class header line), read by the probe's step; the plans each ``SymbolPlanner`` arm is given are in
each probe's ``plans`` (``literal``: the target's name in backquotes; ``prose``: its name as words, or
for a needle the docstring's first sentence; ``probe``: the probe's own prompt).

A row has the coding suite's fields that a runner reads (``context_ids``, ``turns``, ``probes`` with
``prompt_ids``, ``turn_end_ids``, ``blueprint``, ``distance``) and the suite's own (``package``,
``files``, ``text_files``, each turn's ``content``). ``context_len`` never exceeds ``total_tokens``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import random
import re
from pathlib import Path
from typing import Any, Iterator

from pace_hf.chat import ChatTemplate
from pace_hf.planner.extract import parse_python

from .repo_probes import KINDS, probe_for, targets_in
from .repo_rename import Renaming

REPO_VERSION = "2"  # bump whenever the generated content changes
PACKAGES = ("click", "jinja2", "rich", "packaging", "markdown_it", "starlette", "yaml", "typer", "urllib3",
            "requests", "attr", "tqdm")
LISTINGS = ("mixed", "cat", "cat-n")
SYSTEM_PROMPT = ("You are a coding agent working in a Python repository. You read files with shell commands; "
                 "answer questions about the code exactly as it is written in the files you read.")
MIN_FILE_CHARS, MAX_FILE_CHARS = 300, 24_000
_MIN_ROOM = 64  # tokens: below this much room left, the reading stops


class RepoSourceError(ValueError):
    """A package that is not installed, or ships no Python source."""


def package_files(package: str) -> list[tuple[str, str]]:
    """``(path relative to the package's parent, text)`` of every ``.py`` file of an installed package
    (decoded as UTF-8, undecodable bytes replaced). A package that is not installed, or has no Python
    source, is a :class:`RepoSourceError` naming it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise RepoSourceError(f"package {package!r} is not installed here, so its source is not either: "
                              f"pip install it, or choose from the installed {', '.join(PACKAGES)}")
    if spec.submodule_search_locations:
        roots = [Path(p) for p in spec.submodule_search_locations]
        files = sorted(f for root in roots for f in root.rglob("*.py") if "__pycache__" not in f.parts)
        base = roots[0].parent
    elif spec.origin and spec.origin.endswith(".py"):
        files, base = [Path(spec.origin)], Path(spec.origin).parent
    else:
        files, base = [], None
    if not files:
        raise RepoSourceError(f"package {package!r} is installed without Python source (origin {spec.origin!r}): "
                              "nothing to read")
    return [(f.relative_to(base).as_posix(), f.read_bytes().decode("utf-8", errors="replace")) for f in files]


def package_identity(package: str) -> dict:
    """What a cached session of ``package`` depends on: its version and its files' sizes and hashes."""
    h = hashlib.sha256()
    for path, text in package_files(package):
        h.update(f"{path}\0{len(text)}\0".encode())
        h.update(hashlib.sha256(text.encode()).digest())
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    return {"package": package, "version": version, "files": h.hexdigest()[:24]}


def _parses(text: str) -> bool:
    return parse_python(text) is not None


def listing(text: str, style: str) -> tuple[str, list[int]]:
    """A file as the command of ``style`` prints it (``cat``, ``cat -n``, ``→``), and the character
    offset where each of its lines starts in that output (plus the output's end)."""
    out, starts = [], []
    at = 0
    for n, line in enumerate(text.splitlines(), 1):
        shown = {"cat": line, "cat -n": f"{n:6}\t{line}", "arrow": f"{n:6}→{line}"}[style]
        starts.append(at)
        out.append(shown)
        at += len(shown) + 1
    starts.append(at)
    return "\n".join(out) + "\n", starts


def _grep(text: str) -> str:
    """``grep -n '^\\s*\\(def\\|class\\) '``: the file's definition lines with their numbers."""
    return "\n".join(f"{n}:{line}" for n, line in enumerate(text.splitlines(), 1)
                     if line.lstrip().startswith(("def ", "class ", "async def "))) + "\n"


def _head(chat, text: str, path: str, room: int):
    """The longest ``head -n K`` of ``text`` whose tool call fits in ``room`` tokens (None below 8 lines)."""
    lines = text.splitlines()

    def group(k):
        return [("assistant", f"The first {k} lines of `{path}`.\n\n$ head -n {k} {path}", "command"),
                ("tool", "\n".join(lines[:k]) + "\n", "head")]

    def size(k):
        return sum(len(chat.encode(chat.block(r, c))) for r, c, _ in group(k))

    lo, hi = 0, len(lines)
    while lo < hi:  # the largest k with size(k) <= room
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= room else (lo, mid - 1)
    return group(lo) if lo >= 8 else None


def _words(name: str) -> str:
    """A name as prose writes it: ``kobe_marita`` -> ``kobe marita``, ``ZovaMu`` -> ``zova mu``."""
    return " ".join(p.lower() for p in re.findall(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])", name.replace("_", " ")))


def _plans(t, probe: dict) -> dict:
    """The plan each SymbolPlanner arm is given for this probe, by style."""
    what = "method" if t.class_line else "function"
    owner, _, leaf = t.qualname.rpartition(".")
    if t.kind == "needle":
        prose = f"Find the {what} that does this: {probe['prompt'].split(chr(34))[1]}"  # the docstring's sentence
        literal = f"Reproduce `{t.qualname}` from `{t.path}`."
    elif t.kind == "signature":
        prose = (f"Call the {_words(leaf)} {what}" + (f" of the {_words(owner)} class" if owner else "")
                 + " with all of its defaults.")
        literal = f"Call `{t.qualname}` with every default."
    else:
        prose = f"Look up the value of the {_words(leaf)} setting in the {_words(Path(t.path).stem)} module."
        literal = f"Recall the value of `{t.qualname}` in `{t.path}`."
    return {"literal": literal, "prose": prose, "probe": probe["prompt"]}


def session_rng(seed: int, index: int) -> random.Random:
    return random.Random(f"repo-session:{REPO_VERSION}:{seed}:{index}")


def build_repo_session(tokenizer, seed: int = 0, session_index: int = 0, total_tokens: int = 32768,
                       packages=PACKAGES, listing_style: str = "mixed", per_kind: int = 2) -> dict:
    """One session row (see the module docstring): the package is drawn (seeded) from ``packages``
    among those with enough source for ``total_tokens``; ``per_kind`` probes of each kind (fewer when
    the files read hold fewer targets; at least one probe in all)."""
    check_knobs(total_tokens, packages, listing_style, per_kind)
    rng = session_rng(seed, session_index)
    sources = {p: package_files(p) for p in packages}
    big_enough = [p for p in packages if sum(len(t) for _, t in sources[p]) / 3.0 >= 1.2 * total_tokens]
    if not big_enough:
        raise ValueError(f"no package of {', '.join(packages)} has source enough for {total_tokens} tokens "
                         f"(largest: {max(sum(len(t) for _, t in s) for s in sources.values()) // 3} tokens, about)")
    package = rng.choice(big_enough)
    files = [(p, t) for p, t in sources[package] if MIN_FILE_CHARS <= len(t) <= MAX_FILE_CHARS]
    rng.shuffle(files)
    renaming = Renaming.for_sources([t for _, t in files if _parses(t)], package, f"{seed}:{session_index}")
    # the first file read holds a definition to probe, so that even a short session has a probe
    names = set(renaming.mapping.values())
    first = next((k for k, (p, t) in enumerate(files) if _parses(t) and len(t) < 2 * total_tokens
                  and targets_in(renaming.apply(t, p), p, names)), 0)
    files.insert(0, files.pop(first))
    chat = ChatTemplate(tokenizer, SYSTEM_PROMPT)

    ids = list(chat.system_ids)
    turns = [{"step": -1, "role": "system", "kind": "system", "start": 0, "end": len(ids), "content": SYSTEM_PROMPT,
              "path": ""}]
    task = (f"Task: you are in a checkout of the `{package}` repository. Read the modules below to learn how the "
            "package is built; afterwards I will ask you about definitions in the files you read, and your answers "
            "must match the files exactly.")
    fixed = len(ids) + len(chat.encode(chat.block("user", task)))
    if fixed + _MIN_ROOM > total_tokens:
        raise ValueError(f"total_tokens={total_tokens} is shorter than the system prompt and the task ({fixed} tokens) "
                         f"plus one file: ask for at least {fixed + 4 * _MIN_ROOM}")

    def add(role, content, kind, path="", step=0):
        block = chat.encode(chat.block(role, content))
        turns.append({"step": step, "role": role, "kind": kind, "start": len(ids), "end": len(ids) + len(block),
                      "content": content, "path": path})
        ids.extend(block)

    add("user", task, "task")
    shown, text_files, head_files, unused, remark = [], [], [], [], None
    for path, text in files:
        if total_tokens - len(ids) < _MIN_ROOM:
            break
        parses = _parses(text)
        try:
            renamed = renaming.apply(text, path) if parses else renaming.words(text)
        except SyntaxError:  # a rename that does not compile is never shown
            continue
        style = {"cat": "cat", "cat-n": "cat -n"}.get(listing_style) or rng.choice(("cat", "cat -n", "arrow"))
        body, starts = listing(renamed, style)
        command = {"cat": f"cat {path}", "cat -n": f"cat -n {path}", "arrow": f"read {path}"}[style]
        group = []
        if rng.random() < 0.3:
            group.append(("assistant", f"Let me see what `{path}` defines first.\n\n$ grep -n '^\\s*\\(def\\|class\\) ' "
                                       f"{path}", "command"))
            group.append(("tool", _grep(renamed), "grep"))
        lead = (remark + " " if remark else "") + f"Now the whole of `{path}`."
        group.append(("assistant", f"{lead}\n\n$ {command}", "command"))
        group.append(("tool", body, "listing"))
        size = sum(len(chat.encode(chat.block(r, c))) for r, c, _ in group)
        if len(ids) + size > total_tokens:
            unused.append((path, renamed))
            continue  # a smaller file may still fit whole
        for role, content, kind in group:
            add(role, content, kind, path)
        if parses:
            shown.append({"turn": len(turns) - 1, "path": path, "source": renamed, "starts": starts})
        else:
            text_files.append(path)
        found = targets_in(renamed, path, set(renaming.mapping.values())) if parses else []
        remark = (f"(`{found[0].qualname}` is defined in `{path}`.)" if found and rng.random() < 0.25 else None)
    for path, renamed in unused[:1]:  # the room left: as much of a file as fits, an agent's `head -n K`
        head = _head(chat, renamed, path, total_tokens - len(ids))
        if head is not None:
            for role, content, kind in head:
                add(role, content, kind, path)
            head_files.append(path)
    if len(ids) < 0.9 * total_tokens:
        raise ValueError(f"package {package!r} has too little source that fits for total_tokens={total_tokens}: "
                         f"the session holds {len(ids)} tokens; ask for fewer tokens")

    probes, blueprint = _probes(chat, tokenizer, shown, turns, rng, per_kind, renaming)
    needed_end = max(b["end"] for b in blueprint)
    return {
        "session_id": f"repo{seed}-{session_index}@{total_tokens}", "seed": int(seed),
        "session_index": int(session_index), "total_tokens": int(total_tokens), "package": package,
        "listing": listing_style, "system_prompt": SYSTEM_PROMPT, "context_ids": ids, "context_len": len(ids),
        "distance": len(ids) - needed_end, "turn_end_ids": chat.turn_end_ids(), "turns": turns, "probes": probes,
        "blueprint": blueprint, "files": [s["path"] for s in shown], "text_files": text_files, "head_files": head_files,
        "renamed_names": len(renaming.mapping), "generator_version": REPO_VERSION,
    }


def _probes(chat, tokenizer, shown, turns, rng, per_kind, renaming):
    """Up to ``per_kind`` probes of each kind, each about a distinct definition that is defined once in
    the session; and the oracle blueprint (the tokens of each probe's definition)."""
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    names = set(renaming.mapping.values())
    found = [(s, t) for s in shown for t in targets_in(s["source"], s["path"], names)]
    defined: dict[str, int] = {}
    for s in shown:
        for t in {t.qualname for t in targets_in(s["source"], s["path"], names)}:
            defined[t] = defined.get(t, 0) + 1
    picked = []
    for kind in KINDS:
        pool = [(s, t) for s, t in found if t.kind == kind and defined[t.qualname] == 1
                and t.qualname not in {p.qualname for _, p in picked}]
        picked += rng.sample(pool, min(per_kind, len(pool)))
    if not picked:
        raise ValueError("the files this session read hold no definition to probe (no function with a docstring, "
                         "no defaults, no module constant): ask for more tokens")
    rng.shuffle(picked)
    probes, blueprint = [], []
    for k, (s, t) in enumerate(picked, 1):
        probe = probe_for(t, count)
        turn = turns[s["turn"]]
        offsets, _, at = chat.content_offsets("tool", turn["content"])
        starts = s["starts"]
        chars = [(starts[t.first - 1], starts[t.last] - 1)]
        if t.class_line:
            chars.insert(0, (starts[t.class_line - 1], starts[t.class_line] - 1))
        for a, b in chars:
            got = offsets.span(a + at, b + at)
            blueprint.append({"start": turn["start"] + got[0], "end": turn["start"] + got[1], "readers": [k]})
        text = chat.block("user", probe["prompt"]) + chat.gen_header + probe["answer_prefix"]
        probes.append({**probe, "name": f"{t.kind}:{t.qualname}", "step": k, "prompt_ids": chat.encode(text),
                       "plans": _plans(t, probe)})
    return probes, blueprint


def check_knobs(total_tokens, packages, listing_style, per_kind) -> None:
    if not isinstance(total_tokens, int) or isinstance(total_tokens, bool) or total_tokens <= 0:
        raise ValueError(f"total_tokens must be a positive int, got {total_tokens!r}")
    if isinstance(packages, str) or not packages:
        raise ValueError(f"packages must be a non-empty list of package names, got {packages!r}")
    if listing_style not in LISTINGS:
        raise ValueError(f"listing must be one of {LISTINGS}, got {listing_style!r}")
    if not isinstance(per_kind, int) or per_kind < 1:
        raise ValueError(f"per_kind must be an int >= 1, got {per_kind!r}")


def session_messages(row) -> list:
    """The session's turns (system prompt excluded) as ``pace_hf.session.Message`` objects, with the
    exact content each turn was built from."""
    from pace_hf.session import Message

    out = []
    for turn in row["turns"]:
        if turn["role"] != "system":
            out.append(Message(len(out), turn["role"], turn["content"], turn["start"], turn["end"], turn["step"]))
    return out


# -- the loader: sessions as a cached datasets.Dataset ---------------------------------------------------------


def _features():
    from datasets import Features, Sequence, Value

    span = {"start": Value("int64"), "end": Value("int64")}
    return Features({
        "session_id": Value("string"), "seed": Value("int64"), "session_index": Value("int64"),
        "total_tokens": Value("int64"), "package": Value("string"), "listing": Value("string"),
        "system_prompt": Value("string"), "context_ids": Sequence(Value("int32")), "context_len": Value("int64"),
        "distance": Value("int64"), "turn_end_ids": Sequence(Value("int32")),
        "turns": [{"step": Value("int64"), "role": Value("string"), "kind": Value("string"), **span,
                   "content": Value("string"), "path": Value("string")}],
        "probes": [{"name": Value("string"), "kind": Value("string"), "target": Value("string"),
                    "path": Value("string"), "step": Value("int64"), "prompt": Value("string"),
                    "prompt_ids": Sequence(Value("int32")), "answer_prefix": Value("string"),
                    "max_new_tokens": Value("int64"), "reference": Value("string"),
                    "plans": {"literal": Value("string"), "prose": Value("string"), "probe": Value("string")}}],
        "blueprint": [{**span, "readers": Sequence(Value("int64"))}],
        "files": Sequence(Value("string")), "text_files": Sequence(Value("string")),
        "head_files": Sequence(Value("string")),
        "renamed_names": Value("int64"), "generator_version": Value("string"),
    })


_TOKENIZERS: dict[str, Any] = {}


def _generate(fingerprint: str, knobs: dict) -> Iterator[dict]:
    tokenizer = _TOKENIZERS[fingerprint]
    for i in range(knobs["n_sessions"]):
        yield build_repo_session(tokenizer, seed=knobs["seed"], session_index=i, total_tokens=knobs["total_tokens"],
                                 packages=knobs["packages"], listing_style=knobs["listing"], per_kind=knobs["per_kind"])


def load_repo_sessions(tokenizer, n_sessions: int = 1, total_tokens: int = 32768, seed: int = 0, packages=PACKAGES,
                       listing_style: str = "mixed", per_kind: int = 2, cache_dir: str | None = None,
                       keep_in_memory: bool = False):
    """``n_sessions`` repo sessions as a :class:`datasets.Dataset` (one row per session), generated or
    loaded from the datasets cache (keyed on the knobs, :data:`REPO_VERSION`, the packages' versions
    and files, and the tokenizer). A package that is not installed is an error before any is built."""
    from datasets import Dataset

    from .sessions import tokenizer_identity

    if not isinstance(n_sessions, int) or n_sessions < 1:
        raise ValueError(f"n_sessions must be an int >= 1, got {n_sessions!r}")
    check_knobs(total_tokens, packages, listing_style, per_kind)
    packages = list(packages)
    knobs = {"n_sessions": n_sessions, "total_tokens": total_tokens, "seed": int(seed), "packages": packages,
             "listing": listing_style, "per_kind": per_kind}
    payload = json.dumps({"generator": REPO_VERSION, "knobs": knobs, "tokenizer": tokenizer_identity(tokenizer),
                          "packages": [package_identity(p) for p in packages]}, sort_keys=True)
    fp = "pace-repo-sessions-" + hashlib.sha256(payload.encode()).hexdigest()[:32]
    _TOKENIZERS[fp] = tokenizer
    try:
        return Dataset.from_generator(_generate, features=_features(), cache_dir=cache_dir, keep_in_memory=keep_in_memory,
                                      gen_kwargs={"fingerprint": fp, "knobs": knobs}, fingerprint=fp)
    except Exception as e:  # datasets wraps the generator's error: raise the session's own, which says why
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ValueError):
            raise cause from None
        raise
    finally:
        _TOKENIZERS.pop(fp, None)
