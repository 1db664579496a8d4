"""The library's structure (issues 12 and 23): the core knows nothing of the benchmark, and no package has
an import cycle.

Core modules are every module under ``pace_hf/`` outside ``pace_bench/metrics/``; the benchmark is the
top-level package ``pace_bench/``. No core module imports the benchmark, the metric or the model-wheel
loader (absolute or relative imports, at any depth in the module), and none mentions the benchmark, in
code, strings or comments. Scoring imports nothing of the cache (a policy scores plain tensors), and the
integration with transformers (``binding``, ``attention``) imports no cache (it talks to small protocols).
The import graphs are read with ``ast`` (every import, including those inside functions and under
``TYPE_CHECKING``), never by importing.
"""

import ast
import re
import sys
from pathlib import Path

import pytest

import pace_hf

ROOT = Path(pace_hf.__file__).parent
BENCH = ROOT.parent / "pace_bench"
FORBIDDEN = ("pace_bench", "pace_hf.metrics", "pace_hf.bench", "pace_hf.models")  # the last three: old homes
MENTIONS = re.compile(r"\bbench(mark)?s?\b|pace[-_]bench|pace_coding|load_sessions|PACE_ALLOW_CODE_EVAL", re.I)

SCORING = "pace_hf.scoring"  # scores plain tensors: nothing of the cache
INTEGRATION = ("pace_hf.binding", "pace_hf.attention")  # the transformers seam: small protocols, no cache class
CACHE = "pace_hf.cache"


def package_modules(root: Path) -> dict[str, Path]:
    """Every module under the package ``root``, by dotted name."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def core_modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def module_name(path: Path, root: Path | None = None) -> str:
    root = root or ROOT
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path):
    """Each import of ``path`` as ``(module, names)``, relative ones resolved against ``root``'s package:
    ``import a.b`` gives ``("a.b", ())``, ``from .x import y`` gives ``("pkg.x", ("y",))``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            yield target, tuple(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            yield str(node.args[0].value), ()


def imported_modules(path: Path, root: Path | None = None) -> set[str]:
    """Every module ``path`` imports, resolved to an absolute name (``from . import x`` gives both the
    package and ``package.x``, since x may be a module)."""
    out = set()
    for target, names in _imports(path, root or ROOT):
        out.add(target)
        out.update(f"{target}.{n}" for n in names)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports. ``from pkg import name`` points at
    ``pkg.name`` when that is a module and at ``pkg`` otherwise; a parent package's implicit import
    is not an edge (it would make every package a cycle with its own ``__init__``)."""
    modules = package_modules(root)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target, names in _imports(path, root):
            submodules = {f"{target}.{n}" for n in names} & modules.keys()
            edges |= submodules | ({target} if len(submodules) < len(names) or not names else set())
        graph[name] = {m for m in edges if m in modules} - {name}
    return graph


def find_cycle(graph: dict[str, set[str]], ignore: set[tuple[str, str]] = frozenset()) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if (node, nxt) in ignore:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def _forbidden(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))


def test_there_are_core_modules_and_the_evidence_lives_apart():
    names = {module_name(p) for p in core_modules()}
    assert {"pace_hf.cache", "pace_hf.chat", "pace_hf.session"} <= names or \
        {"pace_hf.cache.eviction", "pace_hf.chat", "pace_hf.session"} <= names
    assert not (ROOT / "models.py").exists() and not (ROOT / "sandbox.py").exists()
    assert not (ROOT / "bench").exists(), "the benchmark is the top-level package pace_bench"
    assert (BENCH / "models.py").exists() and (BENCH / "runner.py").exists()


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_imports_nothing_of_the_benchmark(path):
    assert not _forbidden(imported_modules(path))


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_module_does_not_mention_the_benchmark(path):
    hits = [f"{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1) if MENTIONS.search(line)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("root", [ROOT, BENCH], ids=lambda p: p.name)
def test_no_import_cycle(root):
    graph = import_graph(root)
    assert len(graph) > 5
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _imports_of(prefix: str) -> dict[str, set[str]]:
    return {module_name(p): imported_modules(p) for p in core_modules()
            if module_name(p) == prefix or module_name(p).startswith(prefix + ".")}


def _within(modules: set[str], prefix: str) -> set[str]:
    return {m for m in modules if m == prefix or m.startswith(prefix + ".")}


def test_scoring_imports_nothing_of_the_cache():
    found = _imports_of(SCORING)
    assert len(found) > 3
    assert {name: _within(mods, CACHE) for name, mods in found.items() if _within(mods, CACHE)} == {}


def test_the_cache_imports_nothing_of_the_memory_wing():
    """The cache evicts and tells its memory; it never reaches into spill, restore or persist itself."""
    found = _imports_of(CACHE)
    assert len(found) > 3
    assert {name: _within(mods, "pace_hf.memory") for name, mods in found.items()
            if _within(mods, "pace_hf.memory")} == {}


@pytest.mark.parametrize("name", INTEGRATION)
def test_integration_imports_no_cache_class(name):
    (mods,) = _imports_of(name).values()
    assert not _within(mods, CACHE)


def test_the_cycle_check_finds_cycles_and_ignores_parent_packages(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {"__init__.py": "from .a import A\nfrom .sub import S\n",
             "a.py": "from .b import B\nA = 1\n",
             "b.py": "def f():\n    from . import c\nB = 2\n",
             "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n",
             "sub/__init__.py": "from .s import S\n",
             "sub/s.py": "from ..b import B\nS = 3\n"}
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.sub.s"] == {"pkg.b"}  # not pkg or pkg.sub: their import is implicit
    assert graph["pkg.b"] == {"pkg.c"}  # "from . import c" names the module, not the package
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert find_cycle(graph, ignore={("pkg.c", "pkg.a")}) is None
    (pkg / "c.py").write_text("from . import A\n")  # a name of the package's __init__: a real edge
    assert find_cycle(import_graph(pkg)) == ["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg"]


def test_the_import_check_sees_relative_and_absolute_imports(tmp_path, monkeypatch):
    fake = tmp_path / "pace_hf"
    (fake / "rope").mkdir(parents=True)
    lines = {"a.py": "from .bench import load_sessions\n",
             "b.py": "from . import metrics\n",
             "rope/c.py": "from ..metrics.pace_coding import sandbox\n",
             "d.py": "import pace_bench.metrics.pace_coding.sandbox as s\n",
             "e.py": "def f():\n    from pace_bench import runner\n",
             "f.py": "import importlib\nimportlib.import_module('pace_bench.models')\n",
             "g.py": "import pace_bench\n",
             "ok.py": "from .blueprint import Span\nfrom . import chat\nimport pace_hf.cache\n",
             "rope/ok.py": "from ..binding import Binding\n"}
    for rel, text in lines.items():
        (fake / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    found = {rel: _forbidden(imported_modules(fake / rel)) for rel in lines}
    assert all(found[rel] for rel in lines if "ok" not in rel), found
    assert not found["ok.py"] and not found["rope/ok.py"]


def test_no_entry_point_of_the_core_reaches_the_benchmark():
    """A plugin group the core reads (as pace-serve once read ``pace_hf.model_loaders``) must not resolve to
    benchmark code: the benchmark's loader is named explicitly (``pace-serve --loader``)."""
    import tomllib

    project = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["project"]
    for group, points in project.get("entry-points", {}).items():
        assert not [t for t in points.values() if t.split(":")[0].split(".")[0] == "pace_bench"], group
    assert all(not line.strip().startswith("entry_points(") for p in core_modules() for line in p.read_text().splitlines())


def _private_fields_of_eviction_cache() -> set[str]:
    """The ``self._x`` names ``EvictionCache`` assigns or defines: its private state and helpers."""
    tree = ast.parse((ROOT / "cache" / "eviction.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EvictionCache")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
             and not n.name.startswith("__")}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            names.add(node.attr)
    return names


def test_only_the_cache_and_the_memory_wing_read_the_caches_private_fields():
    private = _private_fields_of_eviction_cache()
    assert {"_step", "_held", "_chunk", "_rows"} <= private
    outside = [p for p in core_modules() if p.relative_to(ROOT).parts[0] not in ("cache", "memory")]
    outside += sorted(BENCH.rglob("*.py")) + sorted((ROOT.parent / "bench").rglob("*.py"))
    hits = []
    for path in outside:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                hits.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not hits, hits
