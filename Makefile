# raylane: the two contract commands are `make quickstart` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install quickstart test test-unit lint graph format bench docs clean

install: $(STAMP)

# Re-runs only when pyproject.toml changes, so `make test` is quick once installed.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

quickstart: install
	$(BIN)/raylane quickstart

test: install
	$(BIN)/python -m pytest

test-unit: install
	$(BIN)/python -m pytest tests/unit

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PYTHONPATH=platform $(BIN)/lint-imports

graph: install
	PYTHONPATH=platform $(BIN)/python tools/import_graph.py

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The documentation site (docs/, mkdocs.yml) into site/; --strict fails on a broken link.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: install
	$(BIN)/python benchmarks/job_startup.py
	$(BIN)/python benchmarks/train_overhead.py
	$(BIN)/python benchmarks/pipeline_bubble.py
	$(BIN)/python benchmarks/tune_vs_grid.py
	$(BIN)/python benchmarks/serve_load.py
	$(BIN)/python benchmarks/generate_load.py

clean:
	rm -rf runs data mlruns mlartifacts mlflow.db .pytest_cache
