# Fresh clone: `make demo` runs the project's default job, `make test` the whole test suite
# (what CI runs), `make test-fast` the quick loop: unit tests and a handful of end-to-end
# ones, everything not marked slow (a few minutes on 2 cores).
# Both create .venv and install torch==2.13.0 before anything else (a newer or unpinned
# torch would pull a multi-GB CUDA build where a CPU wheel is all that is wanted).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true

.PHONY: venv demo test test-fast lint typecheck docs check clean

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

test-fast: venv
	$(PY) -m pytest -q -m "not slow"

lint: venv
	$(VENV)/bin/ruff check ulysses_mm tests benchmarks examples docs/hooks.py
	$(VENV)/bin/ruff format --check ulysses_mm tests benchmarks examples docs/hooks.py
	$(PY) -m ulysses_mm.tools.layers

typecheck: venv
	$(VENV)/bin/mypy

# the docs site (docs/, mkdocs.yml) into build/site; --strict: a broken link, a missing
# page or a missing benchmark results file fails the build
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

check: lint typecheck docs test

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
