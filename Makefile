# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# CI runs `make test` on a fresh clone (.ci/run).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean chromium sim-core

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,runtime,torch,mlx,plots]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardmesh demo

# The gates, cheapest first: lint, format, types (pyproject's [tool.mypy] `files`
# says what), then the suite (tests/test_layering.py checks the import direction).
test: lint chromium
	$(BIN)/mypy
	$(BIN)/pytest

# tests/runtime/api/test_web_page.py drives Debian's chromium (never Playwright's own
# browsers): install it where it is missing and apt-get exists (CI runs as
# root). Where it cannot be installed, that test skips and says why.
CHROMIUM ?= /usr/bin/chromium
chromium:
	@if [ ! -x $(CHROMIUM) ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium for the browser test (apt-get)"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends chromium >/dev/null; } \
		|| echo "could not install chromium: tests/runtime/api/test_web_page.py will fail"; \
	fi

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m benchmarks.gossip --json

# The simulator's hot modules compiled with mypyc into build/sim-core/ (about a
# minute; needs a C compiler). Run simulations on it with
# SHARDMESH_SIM_CORE=build/sim-core (simulations/compiled.py says more).
sim-core: $(STAMP)
	$(BIN)/python -c 'import sys; from simulations.compiled import main; sys.exit(main())'

clean:
	rm -rf $(VENV) build *.egg-info
