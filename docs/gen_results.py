"""The site's result tables, generated from ``bench/results/`` at build time (a MkDocs hook, see mkdocs.yml).

Every folder under ``bench/results/`` that holds a Markdown report (``table.md`` first, then any other
``*.md``: ``report.md``, ``robustness.md``, ...) becomes one page, ``benchmarks/results/<folder>/``, with
the report included as it is, the figures of the folder beside it, the settings of its ``run.json`` and
the command that produced it. The "Result tables" page lists them all, with each report's first line;
the sidebar does not (some 50 folder names would crowd every page's navigation). The command is read, in
this order, from:

1. a ``command`` file in the folder (its text, as run from the repository's root);
2. a ``"command"`` entry of the folder's ``run.json`` (a string, or a list of arguments);
3. ``COMMANDS`` below, by the folder's path (or, for one report of a folder, ``folder/file.md``), or by
   its nearest listed parent folder (a stage or a point of a larger run).

A folder that none of them names still gets its page, saying the command was not recorded. Folders are
found when the site builds, so a new results folder needs nothing here: drop a ``command`` file in it to
name its command. Nothing is written into ``docs/``: the pages and figures are added to the build only.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

RESULTS = Path("bench") / "results"
PAGES = "benchmarks/results"  # where the generated pages live in the site
IMAGES = (".png", ".svg", ".jpg", ".jpeg", ".gif")

_CODE = "PACE_ALLOW_CODE_EVAL=1 "
_RULER_GEMMA3 = ('PLAN=hybrid MODEL=gemma3-270m ARMS=full,h2o,snapkv,pace_retrieval DTYPE=auto \\\n'
                 '    EXTRA="--budget 1024 --limit 4096 --chunk 2048" OUT=runs/ruler_gemma3 '
                 'RESULTS=bench/results/ruler_gemma3 \\\n    bash bench/run_ruler.sh')
_REPO_STAGE = "python -m pace_bench --suite repo --model qwen2.5-coder-0.5b --probes-per-kind 3 --dtype float32 --resume"

# The commands of the folders that hold neither a ``command`` file nor a command in ``run.json``: the ones
# the README and the scripts' headers give. A key is a folder under bench/results (or folder/report.md).
COMMANDS = {
    "demo": "make demo   # " + _CODE + "pace-bench --arms h2o,pace --sessions 1 --tokens 12288 --distance 8192 --out runs/demo",
    "48k": _CODE + "pace-bench --arms h2o,pace,retention_only,positions_only \\\n"
                   "    --sessions 3 --tokens 49152 --budget 2048 --chunk 4096 --limit 8192 --resume --out runs/48k",
    "48k-baselines": _CODE + "pace-bench --arms snapkv,streaming --sessions 3 --tokens 49152 --resume --out runs/48k-baselines",
    "calibration": _CODE + "pace-bench --arms full --sessions 5 --tokens 8192 --reference-arm full --out runs/calib",
    "sweep": _CODE + "pace-bench --arms retention_only,pace --sessions 2 --tokens 49152 \\\n"
                     "    --distance 46080 2048 32768 16384 --resume --out runs/sweep",
    "sweep-h2o": _CODE + "pace-bench --arms h2o --sessions 1 --tokens 49152 --distance 46080 2048 --resume --out runs/sweep-h2o",
    "sweep-all": "python -m pace_bench.figures runs/sweep runs/sweep-h2o --out runs/sweep-all",
    "length/96k": _CODE + "pace-bench --arms pace,positions_only --reference-arm positions_only --sessions 1 \\\n"
                          "  --tokens 98304 --resume --out runs/length-96k",
    "length/192k": _CODE + "pace-bench --arms pace,positions_only --reference-arm positions_only --sessions 1 \\\n"
                           "  --tokens 196608 --resume --out runs/length-192k",
    "length/1m": "bash bench/run_1m.sh              # the session, resumable; then its report:\n"
                 "python bench/session_1m_report.py",
    "planner48k/oracle": _CODE + "pace-bench --arms pace --tokens 49152 --seed 1 --out runs/oracle",
    "planner48k/h2o": _CODE + "pace-bench --arms h2o --tokens 49152 --seed 1 --out runs/h2o",
    "planner48k/symbols": _CODE + "pace-bench --arms pace --planner symbols --tokens 49152 --seed 1 --out runs/symbols",
    "planner48k/none_rehydrate": _CODE + "pace-bench --arms pace --planner none --store host --rehydrate "
                                         "--tokens 49152 --seed 1 --out runs/none",
    "robustness": _CODE + "python bench/robustness.py --tokens 8192 --distance 6144 --seed 2 \\\n"
                          "    --drops 0,0.25,0.5,1 --out bench/results/robustness",
    "repo32k": "bash bench/run_repo.sh   # its stage 1:\n" + _REPO_STAGE + " --out runs/repo32k-v2 \\\n"
               "    --tokens 32768 --sessions 1 --arms h2o,snapkv,pace_oracle,pace_prose,full,pace_literal,pace_probe,pace_rehydrate",
    "repo64k": "bash bench/run_repo.sh   # its stage 2:\n" + _REPO_STAGE + " --out runs/repo64k \\\n"
               "    --tokens 65536 --sessions 2 --arms h2o,pace_oracle,pace_prose,snapkv,pace_rehydrate",
    "repo32k-more": "bash bench/run_repo.sh   # its stage 3:\n" + _REPO_STAGE + " --out runs/repo32k-more \\\n"
                    "    --tokens 32768 --sessions 3 --arms h2o,pace_oracle,pace_prose,pace_retrieval",
    "ruler": "bash bench/run_ruler.sh   # nine resumable stages (the script's header lists them)",
    "bfcl_chain": "bash bench/run_bfcl_chain.sh   # three resumable stages (the script's header lists them)",
    "ruler_gemma3": _RULER_GEMMA3,
    "ppl_gemma3": "python bench/perplexity.py --model gemma3-270m --tokens 32768 --chunk 2048 --budget 1024 --limit 4096 \\\n"
                  "    --arms full,h2o,snapkv,pace --out runs/ppl-gemma3",
    "retrieval_recall/links_blocks.md": "python bench/retrieval_recall.py --split dev,held-out,ruler --sessions 6 --seeds 5 "
                                        "--follow off,on --json links_blocks.json",
    "retrieval_recall/signals.md": "python bench/retrieval_recall.py --sessions 6 --signals lexical,digest,both",
}


def _root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def result_folders(root: Path) -> list[Path]:
    """Every folder under bench/results holding a Markdown report, as paths relative to bench/results,
    sorted so that a folder comes before the folders inside it."""
    base = root / RESULTS
    found = {md.parent.relative_to(base) for md in base.rglob("*.md")}
    return sorted((f for f in found if f != Path(".")), key=lambda f: [_natural(part) for part in f.parts])


def _natural(name: str) -> tuple:
    """Sort key: a length (96k, 192k, 1m) by its value, any other name by its text."""
    match = re.fullmatch(r"(\d+)([km])", name)
    return (0, int(match[1]) * {"k": 1_000, "m": 1_000_000}[match[2]], "") if match else (1, 0, name)


def reports(folder: Path) -> list[Path]:
    """A folder's Markdown reports: ``table.md`` first, then the others by name."""
    return sorted(folder.glob("*.md"), key=lambda p: (p.name != "table.md", p.name))


def command(root: Path, rel: Path, report: str | None = None) -> tuple[str | None, str]:
    """The command that produced ``bench/results/rel`` (or its ``report``), and where it was read."""
    folder = root / RESULTS / rel
    if report is None:
        if (folder / "command").is_file():
            return (folder / "command").read_text().strip(), f"`{(RESULTS / rel / 'command').as_posix()}`"
        try:
            recorded = json.loads((folder / "run.json").read_text()).get("command")
        except (OSError, ValueError, AttributeError):
            recorded = None
        if recorded:
            text = recorded if isinstance(recorded, str) else shlex.join(map(str, recorded))
            return text, f"`{(RESULTS / rel / 'run.json').as_posix()}`"
    else:
        key = f"{rel.as_posix()}/{report}"
        return (COMMANDS[key], "this site's list of commands (`docs/gen_results.py`)") if key in COMMANDS else (None, "")
    for parent in (rel, *rel.parents):
        if parent.as_posix() in COMMANDS:
            where = "this site's list of commands (`docs/gen_results.py`)"
            if parent != rel:
                where += f", the run of `{(RESULTS / parent).as_posix()}` that this folder is a part of"
            return COMMANDS[parent.as_posix()], where
    return None, ""


def _demote(text: str) -> str:
    """Headings two levels down, so a report's ``#`` sits under the report's own heading."""
    return re.sub(r"^(#{1,4}) ", r"##\1 ", text, flags=re.M)


def _blank_before_tables(text: str) -> str:
    """A blank line before a table that follows a line of text (a script's report may have none, and
    Markdown then reads the table as part of the paragraph)."""
    out, fence = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
        if not fence and line.startswith("|") and out and out[-1].strip() and not out[-1].startswith("|"):
            out.append("")
        out.append(line)
    return "\n".join(out)


def _command_block(text: str | None, where: str) -> str:
    if text is None:
        return ("The command that produced it was not recorded: put it in a `command` file in the folder "
                "(or add it to `COMMANDS` in `docs/gen_results.py`).\n")
    return f"Produced by (from {where}):\n\n```bash\n{text}\n```\n"


def _settings(folder: Path) -> str:
    try:
        settings = json.loads((folder / "run.json").read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(settings, dict):
        return ""
    rows = "\n".join("| `" + k + "` | `" + json.dumps(v).replace("|", "\\|") + "` |" for k, v in settings.items() if k != "command")
    if not rows:
        return ""
    return '??? note "Settings (`run.json`)"\n\n    | setting | value |\n    |---|---|\n' + \
        "\n".join("    " + r for r in rows.splitlines()) + "\n"


def title(rel: Path) -> str:
    return rel.as_posix()


def page(root: Path, rel: Path) -> tuple[str, list[Path]]:
    """The Markdown of the page of ``bench/results/rel``, and the figures it shows."""
    folder = root / RESULTS / rel
    parts = [f"# `bench/results/{rel.as_posix()}`\n"]
    own_command, where = command(root, rel)
    texts = [(md, md.read_text()) for md in reports(folder)]
    per_report = {md.name: command(root, rel, md.name) for md, _ in texts}
    if own_command is not None or not any(c for c, _ in per_report.values()):
        parts.append(_command_block(own_command, where))
    settings = _settings(folder)
    if settings:
        parts.append(settings)
    for md, text in texts:
        parts.append(f"## `{md.name}`\n")
        report_command, report_where = per_report[md.name]
        if report_command is not None:
            parts.append(_command_block(report_command, report_where))
        parts.append(_blank_before_tables(_demote(text.strip())) + "\n")
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGES)
    shown = "\n".join(text for _, text in texts)
    figures = [p for p in images if f"]({p.name})" not in shown]
    if figures:
        parts.append("## Figures\n")
        parts += [f"![{p.stem}]({p.name})\n" for p in figures]
    others = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() not in IMAGES + (".md",)
                    and p.name != "command")
    if others:
        parts.append("Also in the folder: " + ", ".join(f"`{n}`" for n in others) + ".\n")
    return "\n".join(parts), images


def _first_line(root: Path, rel: Path) -> str:
    for md in reports(root / RESULTS / rel):
        for line in md.read_text().splitlines():
            line = line.strip().lstrip("#").strip()
            if line and not line.startswith("|"):
                return line.replace("|", "\\|")
    return ""


def index(root: Path, folders: list[Path]) -> str:
    rows = "\n".join(f"| [`{f.as_posix()}`]({f.as_posix()}/index.md) | {_first_line(root, f)} |" for f in folders)
    return f"""# Result tables

Every folder of `bench/results/` that holds a Markdown report, as the benchmark scripts wrote it, with
the command that produced it. These pages are generated when the site is built (`docs/gen_results.py`),
so a new results folder shows up here by itself. The [benchmark pages](../index.md) explain the
protocols and what the numbers show.

| folder | what it holds |
|---|---|
{rows}
"""


# -- MkDocs hooks ---------------------------------------------------------------------------------------

def on_files(files: Files, config) -> Files:
    root = _root(config)
    folders = result_folders(root)
    files.append(File.generated(config, f"{PAGES}/index.md", content=index(root, folders)))
    copied = set()
    for rel in folders:
        text, images = page(root, rel)
        files.append(File.generated(config, f"{PAGES}/{rel.as_posix()}/index.md", content=text,
                                    inclusion=InclusionLevel.NOT_IN_NAV))  # the Result tables page lists them
        for image in images:
            uri = f"{PAGES}/{rel.as_posix()}/{image.name}"
            files.append(File.generated(config, uri, abs_src_path=str(image)))
            copied.add(uri)
    # Figures of result folders without a report that the narrative pages show (e.g. speed/prefill48k).
    for image in sorted((root / RESULTS).rglob("*")):
        if image.suffix.lower() in IMAGES:
            uri = f"{PAGES}/{image.parent.relative_to(root / RESULTS).as_posix()}/{image.name}"
            if uri not in copied:
                files.append(File.generated(config, uri, abs_src_path=str(image)))
    return files


def on_serve(server, config, builder):
    server.watch(str(_root(config) / RESULTS))
    return server
