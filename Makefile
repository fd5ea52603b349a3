# Strata: `make serve` and `make test` set up everything they need on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.strata-installed
DATA_DIR ?= .strata
# The Linux mlx-cpu wheel bundles a reference BLAS; Debian's OpenBLAS is ~10-30x faster on this CPU.
OPENBLAS = $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0))
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

AGENTS := tests/agents
AGENTS_STAMP := $(AGENTS)/node_modules/.strata-installed

.PHONY: setup test-tools agents cluster-tools serve cluster lint format check test mutants bench clean

setup: $(STAMP)

$(STAMP): requirements.lock constraints.txt pyproject.toml
	@if [ "$$(uname -s)" = Linux ] && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
		echo "installing OpenBLAS (libopenblas0-pthread)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libopenblas0-pthread; \
	fi
	@# OpenCV's wheel (video_url parts, and mlx-vlm's video paths) loads these system libraries
	@if [ "$$(uname -s)" = Linux ] && ! (ldconfig -p | grep -q libGL.so.1 && ldconfig -p | grep -q libgthread-2.0.so.0 \
			&& ldconfig -p | grep -q libxcb.so.1); then \
		echo "installing the libraries OpenCV loads (libgl1, libglib2.0-0, libxcb1)"; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends libgl1 libglib2.0-0 libxcb1; \
	fi
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -r requirements.lock
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

serve: setup
	$(BIN)/strata serve --host 127.0.0.1 --port 8000 --model demo --data-dir $(DATA_DIR)

# Redis, two replicas (ports 8001, 8002) and HAProxy on 8000, with the demo model; Ctrl-C stops them.
cluster-tools:
	@if [ "$$(uname -s)" = Linux ] && ! (command -v redis-server && command -v haproxy) >/dev/null; then \
		echo "installing redis-server and haproxy"; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends redis-server haproxy; \
	fi

cluster: setup cluster-tools
	$(BIN)/strata cluster up --model demo --port 8000 --data-dir $(DATA_DIR)/cluster

# Tools the tests start for real: Prometheus (and promtool) scrape and check the metrics and alert
# rules, headless Chromium loads the dashboard, redis-server holds the shared exact cache, HAProxy
# routes to replicas. Installed from Debian when missing.
test-tools:
	@if [ "$$(uname -s)" = Linux ] && ! (command -v prometheus && command -v promtool && command -v chromium \
			&& command -v redis-server && command -v haproxy) >/dev/null; then \
		echo "installing prometheus, chromium, redis-server and haproxy for the tests"; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends prometheus chromium fonts-dejavu-core redis-server haproxy; \
	fi

# The coding agents the acceptance tests drive (tests/agents): Claude Code, Codex CLI and opencode,
# the npm releases pinned in tests/agents/package.json and its lock. Node.js and npm from Debian when
# missing; the agents' own native binaries come inside their npm packages.
agents: $(AGENTS_STAMP)

$(AGENTS_STAMP): $(AGENTS)/package.json $(AGENTS)/package-lock.json
	@if ! command -v npm >/dev/null; then \
		echo "installing nodejs and npm"; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends nodejs npm; \
	fi
	cd $(AGENTS) && npm install --no-audit --no-fund --loglevel=error
	touch $@

# Style, types (pinned ruff and mypy, configured in pyproject.toml) and the docs site (mkdocs.yml,
# built strict: a broken page fails): the first step of `make test`.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mkdocs build --strict --quiet

# Rewrites the tree: ruff's safe fixes, then the formatter.
format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The tests run on the server's BLAS (gateway/blas.py prints it as NAME=value words): the one-row
# products library, then OpenBLAS (just OpenBLAS where the library cannot be built), and the OpenBLAS
# kernels this CPU's flags allow where OpenBLAS would pick older ones.
BLAS_ENV = $$($(BIN)/python -m gateway.blas)

# The inner loop: lint, types and the tests that start no model, server or outside process (the
# `live` marker, set in tests/conftest.py).
check: lint
	env $(BLAS_ENV) $(BIN)/python -m pytest -q -m "not live" --durations=5 $(PYTEST_ARGS)

# The whole suite, after set-up (venv, Debian test tools, the agents), in two runs: every test not
# marked `serial` on TEST_WORKERS parallel workers (pytest-xdist, one test file per worker at a time,
# so a module's server starts once; the costliest files first, by tests/durations.json) with `make
# lint` beside them; then the `serial` tests (they measure time: latencies, stalls, token gaps) one
# at a time on the otherwise idle machine, collected only from the files that hold them. Each
# parallel worker, and each server it starts, keeps to one BLAS thread: N workers on N cores, not
# N x N OpenBLAS threads spinning for the same cores (that spin was a quarter of the suite's CPU time
# on 2 cores). Each phase's wall time is printed at the end, set-up apart.
TEST_WORKERS ?= auto
SERIAL_FILES = $(shell grep -rl --include='test_*.py' 'mark.serial' tests)
test:
	@start=$$(date +%s); \
	$(MAKE) --no-print-directory setup test-tools agents || exit $$?; \
	ready=$$(date +%s); \
	lint_log=$$(mktemp); $(MAKE) --no-print-directory lint > $$lint_log 2>&1 & lint=$$!; \
	OPENBLAS_NUM_THREADS=1 env $(BLAS_ENV) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
		-m "not serial" --durations=20 $(PYTEST_ARGS); parallel=$$?; \
	wait $$lint; linted=$$?; echo "make lint:"; cat $$lint_log; rm -f $$lint_log; \
	spread=$$(date +%s); \
	env $(BLAS_ENV) $(BIN)/python -m pytest -q -m serial --durations=10 $(PYTEST_ARGS) $(SERIAL_FILES); \
	serial=$$?; done=$$(date +%s); \
	echo "make test: set-up $$((ready - start)) s, parallel tests (lint beside them) $$((spread - ready)) s," \
		"serial tests $$((done - spread)) s (exit codes: lint $$linted, parallel $$parallel, serial $$serial)"; \
	[ $$linted = 0 ] && [ $$parallel = 0 ] && [ $$serial = 0 ]

# Each critical one-line breakage applied to a copy of the checkout must fail its tests (tests/mutants.py).
mutants: setup
	env $(BLAS_ENV) $(BIN)/python tests/mutants.py

bench: setup
	LD_PRELOAD=$(OPENBLAS) $(BIN)/python -m evals.bench_engine

clean:
	rm -rf $(VENV) $(DATA_DIR) .pytest_cache $(AGENTS)/node_modules
