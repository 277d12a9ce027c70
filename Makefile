# The two commands a user needs: `make run` and `make test`. Each creates .venv if missing.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.thinwire-installed

.PHONY: run test test-fast lint bench bench-readme clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# the first run: a race on the bundled default (mnist1d, 2 local workers) of the fp32 all_reduce, bf16, PowerSGD,
# top-k and DaSGD, 3 seeds each, which names the winner at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s where one wins beyond
# the spread over the seeds (else a tie) and writes runs/default/report.md and its plots (about 4 minutes on 2 cores)
RUN_ARGS ?= --methods identity,bf16,powersgd,topk,dasgd --steps 600 --seeds 3 --link 10gbit,10us --link 1gbit,50us \
	--link 100mbit,1ms --out runs/default --overwrite

run: $(STAMP)
	$(VENV)/bin/thinwire compare $(RUN_ARGS)

# the tests run after lint (ruff: style, import order, likely bugs) and types (mypy on src/thinwire);
# both are configured in pyproject.toml. TEST_JOBS test processes at once (pytest-xdist; much of a
# spawned-process test is waiting: start-up, heartbeats, timeouts); TEST_JOBS=0 runs them one by one.
# worksteal: a test process that runs out of tests takes half of another's queue (xdist's default
# hands each its share up front, and one of two was left with the slow tests for minutes alone)
TEST_JOBS ?= 2
# every process a test starts imports thinwire: its modules are compiled once, here (where
# PYTHONDONTWRITEBYTECODE is set, no process would keep what it compiled for the next one)
test: lint
	$(PY) -m compileall -q src tests benchmarks >/dev/null
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal tests

# the unit tests that start no process (a test that does is marked `spawns`), for the edit-test loop
test-fast: $(STAMP)
	$(PY) -m compileall -q src tests >/dev/null
	THINWIRE_TEST_FAST=1 $(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal -m "not spawns" tests/unit

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# the figures README.md states, measured again at one commit into benchmarks/results/readme.md (about 37 minutes
# on 2 cores); the real shaped links need root (network namespaces and tc): run as root for them
bench-readme: $(STAMP)
	$(PY) benchmarks/bench_readme.py

clean:
	rm -rf $(VENV) build src/*.egg-info
