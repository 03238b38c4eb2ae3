# raylane: the two contract commands are `make quickstart` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install quickstart test test-unit lint graph format bench docs clean

install: $(STAMP)

# Re-runs only when pyproject.toml changes, so `make test` is quick once installed.
# torch by pip (its pin in pyproject.toml: pip takes a CPU build where the machine keeps one);
# the rest by uv, which resolves the same versions as pip in about a third of the time. uv reads
# no pip configuration, so it is handed the indexes and find-links pip is configured with, and
# compiles the bytecode as pip does (without it every Ray worker recompiles what it imports).
TORCH = $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
UV    = uv==0.13.9
PIP_SOURCES = $(foreach u,$(shell $(PYTHON) -m pip config get global.extra-index-url 2>/dev/null),--extra-index-url $(u)) \
	$(foreach d,$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null),--find-links $(d))

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet '$(TORCH)' '$(UV)'
	$(BIN)/uv pip install --quiet --compile-bytecode --index-strategy unsafe-best-match \
		$(PIP_SOURCES) --python $(BIN)/python -e '.[dev]'
	touch $(STAMP)

quickstart: install
	$(BIN)/raylane quickstart

# Two pytest-xdist workers: every integration test in order on one, the unit modules beside
# them on the other (tests/conftest.py's scheduler).
test: install
	$(BIN)/python -m pytest -n 2

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
