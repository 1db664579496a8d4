"""Execute the example notebooks and write them back with their outputs, stripped of this machine.

The committed outputs are the notebooks' defaults (Qwen2.5-Coder-0.5B-Instruct, full sizes), so this
refuses to run with the CI overrides set. What comes out of a kernel also carries things that belong to
the machine, not to the example: library warnings and progress bars on stderr, absolute paths (the
venv, the checkout, the home and temp directories) and execution timestamps. ``strip`` removes them;
tests/test_examples.py fails on a committed notebook that still has any, or a traceback.

    python examples/render.py                        # every notebook, one at a time
    python examples/render.py 02_agent_session.ipynb # one

tests/test_examples.py executes the same notebooks through ``execute`` with the CI overrides.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent
OVERRIDES = ("PACE_EXAMPLES_MODEL", "PACE_EXAMPLES_SMALL")  # what CI sets to run small


def machine_paths() -> list[tuple[str, str]]:
    """The absolute paths of this machine that outputs may show, longest first, and what replaces each."""
    pairs = [(sys.prefix, "<venv>"), (str(ROOT), "<repo>"),
             (os.path.realpath(tempfile.gettempdir()), "<tmp>"), (tempfile.gettempdir(), "<tmp>"),
             (str(Path.home()), "~")]
    pairs = [(p, r) for p, r in pairs if len(p) > 1]
    return sorted(set(pairs), key=lambda pair: -len(pair[0]))


def execute(path: Path, timeout: int | None = None):
    """Run the notebook at ``path`` in a fresh kernel (cwd: examples/) and return it with its outputs;
    raises ``nbclient.exceptions.CellExecutionError`` at the first failing cell."""
    notebook = nbformat.read(path, as_version=4)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()
    return notebook


def _scrub(text: str) -> str:
    for path, replacement in machine_paths():
        text = text.replace(path, replacement)
    return text


def strip(notebook):
    """Drop stderr (warnings, logging, progress bars), replace machine paths in what remains, and drop
    per-cell execution metadata. Refuses a notebook with an error output: that is a broken example."""
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                raise ValueError(f"cell {cell.get('id', '?')} failed: {out.ename}: {out.evalue}")
            if out.output_type == "stream":
                if out.name == "stderr":
                    continue
                out.text = _scrub(out.text)
            elif "data" in out:
                for mime, value in out.data.items():
                    if mime.startswith("text/") and isinstance(value, str):
                        out.data[mime] = _scrub(value)
            kept.append(out)
        cell.outputs = kept
    return notebook


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="notebook file names in examples/ (default: all)")
    args = ap.parse_args(argv)
    if set_ := [k for k in OVERRIDES if k in os.environ]:
        ap.error(f"unset {', '.join(set_)}: the committed outputs are the notebooks' defaults")
    paths = [EXAMPLES / name for name in args.names] or sorted(EXAMPLES.glob("*.ipynb"))
    for path in paths:
        start = time.perf_counter()
        notebook = strip(execute(path))
        nbformat.write(notebook, path)
        print(f"{path.name}: {time.perf_counter() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
