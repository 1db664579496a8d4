"""Every example and notebook runs, and the committed notebooks tell the truth.

CI executes each notebook with nbclient, as a reader would, on a tiny random model (with SmolLM2's
tokenizer and chat template, saved to a directory that ``load_model`` reads) and small sizes: the
notebooks' parameter cell reads ``PACE_EXAMPLES_MODEL`` and ``PACE_EXAMPLES_SMALL``. The committed outputs come
from ``examples/render.py`` on the defaults (Qwen2.5-Coder-0.5B-Instruct); they are checked here for
what must never be committed (a traceback, a warning, a progress bar, a path of this machine) and for
the computed checks that the text of each notebook relies on.
"""

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))

# What each committed notebook prints once its answers were checked, on the bundled model.
COMMITTED_CHECKS = {
    "01_quickstart.ipynb": ["answer contains the vault code 4471: True"],
    "02_agent_session.ipynb": ["the answer names the vault code 4471 and the owner Ada Lovelace: True",
                               "the answer names port 7312: True"],
    "03_benchmark.ipynb": ["PACE passed more hidden checks than H2O on this session"],
    "04_agent.ipynb": ["the first answer is the total balance 48: True", "the second answer is the difference 34: True"],
}


def _render():
    spec = importlib.util.spec_from_file_location("render", EXAMPLES / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _texts(notebook: dict) -> list[str]:
    """Every output of every code cell, as text (images as their base64, which holds no path)."""
    out = []
    for cell in notebook["cells"]:
        for o in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            out.append(json.dumps(o))
    return out


def test_quickstart_script_runs():
    done = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "planned span resident: True" in done.stdout


def test_there_are_four_notebooks():
    assert [p.name for p in NOTEBOOKS] == sorted(COMMITTED_CHECKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_clean_and_its_checks_hold(path):
    notebook = json.loads(path.read_text())
    code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    assert all(c.get("execution_count") for c in code), "render the notebook: a code cell has no outputs"
    assert not [o for c in code for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not [o for c in code for o in c.get("outputs", []) if o.get("name") == "stderr"]
    text = "\n".join(_texts(notebook))
    for bad in ("Traceback", "TqdmWarning", "IProgress", "Warning:", "it/s]", "\\u2588"):
        assert bad not in text, f"{path.name} shows {bad!r} in its outputs"
    machine = {sys.prefix, str(ROOT), str(Path.home()), tempfile.gettempdir(), os.path.realpath(tempfile.gettempdir())}
    for p in machine:
        assert p not in text, f"{path.name} shows a path of this machine: {p}"
    assert not re.search(r"(/home/|/Users/|/root/|/tmp/|site-packages)", text), path.name
    for line in COMMITTED_CHECKS[path.name]:
        assert line in text, f"{path.name}: the committed run does not show {line!r}"
    # the committed outputs are the defaults: the parameter cell's model is the bundled one
    assert '"PACE_EXAMPLES_MODEL", "qwen2.5-coder-0.5b"' in "".join(code[0]["source"])


def test_strip_drops_warnings_progress_and_machine_paths():
    nbformat = pytest.importorskip("nbformat")
    render = _render()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stderr",
                               text=f"{sys.prefix}/lib/tqdm/auto.py:21: TqdmWarning: IProgress not found\n"),
        nbformat.v4.new_output("stream", name="stdout", text=f"saved under {ROOT}/runs and {tempfile.gettempdir()}/x\n"),
        nbformat.v4.new_output("execute_result", data={"text/plain": f"'{Path.home()}/data'"}, execution_count=1),
    ]
    cell.metadata["execution"] = {"iopub.execute_input": "2026-01-01T00:00:00"}
    notebook = render.strip(nbformat.v4.new_notebook(cells=[cell]))
    out = notebook.cells[0].outputs
    assert [o.output_type for o in out] == ["stream", "execute_result"] and out[0].name == "stdout"
    assert out[0].text == "saved under <repo>/runs and <tmp>/x\n"
    assert out[1].data["text/plain"] == "'~/data'"
    assert "execution" not in notebook.cells[0].metadata
    broken = nbformat.v4.new_code_cell("1/0")
    broken.outputs = [nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero", traceback=[])]
    with pytest.raises(ValueError, match="ZeroDivisionError"):
        render.strip(nbformat.v4.new_notebook(cells=[broken]))


def test_render_refuses_the_ci_overrides(monkeypatch):
    pytest.importorskip("nbclient")
    monkeypatch.setenv("PACE_EXAMPLES_SMALL", "1")
    with pytest.raises(SystemExit):
        _render().main(["01_quickstart.ipynb"])


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_without_error(path, monkeypatch, tiny_llama_dir):
    pytest.importorskip("nbclient")
    monkeypatch.setenv("PACE_EXAMPLES_MODEL", str(tiny_llama_dir))  # the kernel inherits the environment
    monkeypatch.setenv("PACE_EXAMPLES_SMALL", "1")
    notebook = _render().execute(path, timeout=300)  # raises CellExecutionError on the first failing cell
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    # the checks are computed, so on the small model they print a verdict either way, never a traceback
    text = "\n".join(_texts(notebook))
    for line in COMMITTED_CHECKS[path.name]:
        prefix = line.rsplit(":", 1)[0] if line.endswith(("True", "False")) else None
        if prefix:
            assert prefix in text, f"{path.name} no longer prints {prefix!r}"
