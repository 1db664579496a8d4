# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo clean

setup: $(STAMP)

# Idempotent: the stamp is rebuilt only when pyproject.toml changes.
# torch is pinned to the CPU build when absent, so nothing pulls a multi-GB CUDA wheel.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

demo: setup
	$(PY) examples/quickstart.py

clean:
	rm -rf $(VENV) build *.egg-info
