# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# CI runs `make test` on a fresh clone (.ci/run).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,runtime,torch,mlx,plots]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardmesh demo

# The gates, cheapest first: lint, format, types (pyproject's [tool.mypy] `files`
# says what), then the suite (tests/test_layering.py checks the import direction).
test: lint
	$(BIN)/mypy
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.gossip --json

clean:
	rm -rf $(VENV) build *.egg-info
