# The two set-up commands of the README: `make demo` (the main job) and `make test`.
# Both create .venv and install what they need on a fresh machine (once; again when
# pyproject.toml changes). TORCH pins the CPU build that lies on this kind of machine's disk;
# on a GPU machine pass e.g. TORCH='torch==2.13.0' from an index with CUDA builds.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: install demo test lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH)'
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/vitserve demo

test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
