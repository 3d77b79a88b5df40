# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# CI runs `make test` on a fresh clone (.ci/run).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check lint bench clean chromium lab-deps sim-core

# pip compiles what it installs to bytecode one file at a time (half of the
# install's minute); compileall does the same on every core. Its exit status is
# ignored as pip ignores the same failures: some wheels ship files written for
# newer Pythons (torch's py312_intrinsics.py) that no 3.11 compiles.
SITE_PACKAGES = $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -e '.[dev,runtime,torch,mlx,plots]'
	$(BIN)/python -m compileall -q -j 0 $(SITE_PACKAGES) > /dev/null 2>&1 || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/shardmesh demo

# The gates: lint and format first, then the suite with the type check beside it
# (pyproject's [tool.mypy] `files` says what; tests/test_layering.py checks the
# import direction). mypy takes most of a minute of one core from cold, so it
# runs at low priority on the CPU the suite leaves idle (its swarm tests mostly
# wait on timers), and its verdict is printed after the suite's; either failing
# fails the target. The suite runs on every core (pytest-xdist); tests that
# start node processes share one worker, one after another, and the longest
# groups are handed out first, in the order tests/conftest.py gives them (so
# xdist's reorder is off).
PARALLEL := -n auto --dist loadgroup --no-loadscope-reorder
TYPES_LOG := $(VENV)/mypy.log
test: lint chromium lab-deps
	@nice -n 10 $(BIN)/mypy > $(TYPES_LOG) 2>&1 & types=$$!; \
	$(BIN)/pytest $(PARALLEL); suite=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $(TYPES_LOG); \
	[ $$suite -eq 0 ] && [ $$typed -eq 0 ]

# The inner loop: lint, types, and every test that starts no node process,
# builds no namespace and is not in the slow tier (unit, in-process and
# simulator tests). CI runs `make test`.
check: lint
	$(BIN)/mypy
	$(BIN)/pytest $(PARALLEL) -m "not slow and not swarm and not lab" --durations=5

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

# The WAN testbed (runtime/lab/, docs/lab.md) builds network namespaces with ip and
# tc (iproute2) and NAT routers with nft: install what is missing where apt-get
# exists (CI runs as root). Where they cannot be installed, the lab tests skip
# and say why.
lab-deps:
	@missing=""; \
	command -v ip >/dev/null 2>&1 || missing="$$missing iproute2"; \
	command -v nft >/dev/null 2>&1 || missing="$$missing nftables"; \
	if [ -n "$$missing" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing for the WAN testbed (apt-get)"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } \
		|| echo "could not install$$missing: the lab tests (tests/runtime/lab/) will skip"; \
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
