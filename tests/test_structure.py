"""The library's structure (issue 12): the core knows nothing of the benchmark.

Core modules are every module under ``pace_hf/`` outside ``pace_hf/bench/`` and ``pace_hf/metrics/``.
None imports the benchmark, the metric or the model-wheel loader (absolute or relative imports, at any
depth in the module), and none mentions the benchmark, in code, strings or comments.
"""

import ast
import re
import sys
from pathlib import Path

import pytest

import pace_hf

ROOT = Path(pace_hf.__file__).parent
EVIDENCE = ("bench", "metrics")  # the benchmark's rooms
FORBIDDEN = ("pace_hf.bench", "pace_hf.metrics", "pace_hf.models")  # pace_hf.models: the loader's old home
MENTIONS = re.compile(r"\bbench(mark)?s?\b|pace[-_]bench|pace_coding|load_sessions|PACE_ALLOW_CODE_EVAL", re.I)


def core_modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in EVIDENCE)


def module_name(path: Path) -> str:
    parts = ("pace_hf", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, resolved to an absolute name (``from . import x`` gives both the
    package and ``package.x``, since x may be a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.add(str(node.args[0].value))
    return out


def _forbidden(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


def test_there_are_core_modules_and_the_evidence_lives_apart():
    names = {module_name(p) for p in core_modules()}
    assert {"pace_hf.cache", "pace_hf.chat", "pace_hf.session"} <= names
    assert not (ROOT / "models.py").exists() and not (ROOT / "sandbox.py").exists()
    assert (ROOT / "bench" / "models.py").exists() and (ROOT / "metrics" / "pace_coding" / "sandbox.py").exists()


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_imports_nothing_of_the_benchmark(path):
    assert not _forbidden(imported_modules(path))


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_does_not_mention_the_benchmark(path):
    hits = [f"{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1) if MENTIONS.search(line)]
    assert not hits, "\n".join(hits)


def test_the_import_check_sees_relative_and_absolute_imports(tmp_path, monkeypatch):
    fake = tmp_path / "pace_hf"
    (fake / "rope").mkdir(parents=True)
    lines = {"a.py": "from .bench import load_sessions\n",
             "b.py": "from . import metrics\n",
             "rope/c.py": "from ..bench.models import load_model\n",
             "d.py": "import pace_hf.metrics.pace_coding.sandbox as s\n",
             "e.py": "def f():\n    from pace_hf.bench import runner\n",
             "f.py": "import importlib\nimportlib.import_module('pace_hf.bench.models')\n",
             "ok.py": "from .blueprint import Span\nfrom . import chat\nimport pace_hf.cache\n",
             "rope/ok.py": "from ..binding import Binding\n"}
    for rel, text in lines.items():
        (fake / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    found = {rel: _forbidden(imported_modules(fake / rel)) for rel in lines}
    assert all(found[rel] for rel in lines if "ok" not in rel), found
    assert not found["ok.py"] and not found["rope/ok.py"]
