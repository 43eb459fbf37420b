# Fresh clone: `make demo` runs the project's default job, `make test` the test suite.
# Both create .venv and install torch==2.13.0 before anything else (a newer or unpinned
# torch would pull a multi-GB CUDA build where a CPU wheel is all that is wanted).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true

.PHONY: venv demo test lint typecheck check clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,s3]'
	touch $(STAMP)

demo: venv
	$(VENV)/bin/ulysses-mm demo

test: venv
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check ulysses_mm tests benchmarks examples
	$(VENV)/bin/ruff format --check ulysses_mm tests benchmarks examples
	$(PY) -m ulysses_mm.tools.layers

typecheck: venv
	$(VENV)/bin/mypy

check: lint typecheck test

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
