"""Every example and notebook runs (notebooks on SmolLM2, executed with nbclient as a reader would)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))


def test_quickstart_script_runs():
    done = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "planned span resident: True" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_without_error(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    client = NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
