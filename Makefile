# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast demo docs clean

setup: $(STAMP)

# Idempotent: the stamp is rebuilt only when pyproject.toml changes.
# torch is pinned to the CPU build when absent, so nothing pulls a multi-GB CUDA wheel.
# bfcl-eval (pace-bench --suite bfcl) goes in with --no-deps, which pyproject cannot say: its wheel declares ~30
# hosted-model clients that its multi-turn modules never import (they need only mpmath, in [bench]).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps bfcl-eval==2026.3.23
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

# For iteration: everything but the tests marked slow (real models, whole scripts). `make test` (CI) runs all.
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# One session of the coding benchmark on the default model (Qwen2.5-Coder-0.5B-Instruct), H2O against
# PACE, definitions 8K tokens before the probes. It runs model-written code in the metric's sandbox, so it
# opts in to code execution for its own run. Prints the table and the paths of the plots.
# The demo's session secret is recorded here, and its dtype pinned, so every run plays the same session and
# prints the same table (a benchmark run draws a fresh secret: its sessions are held out from anything written).
DEMO_SECRET ?= 24538d557209ae83995c2bcd24040c52
DEMO_ARGS ?= --arms h2o,pace --sessions 1 --tokens 12288 --distance 8192 --dtype float32 --secret $(DEMO_SECRET) --out runs/demo
demo: setup
	PACE_ALLOW_CODE_EVAL=1 $(PY) -m pace_bench $(DEMO_ARGS)

# The documentation site (mkdocs.yml, docs/) into site/. --strict: any warning (a dead link or anchor, a
# docstring the API reference cannot read) fails the build. `.venv/bin/mkdocs serve` serves it while editing.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) build *.egg-info site
