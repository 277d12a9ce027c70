# The two commands a user needs: `make run` and `make test`. Each creates .venv if missing.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.thinwire-installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

# the first run: a race on the bundled default (mnist1d, 2 local workers) of the fp32 all_reduce, bf16, PowerSGD,
# top-k and DaSGD, which names the winner at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s and writes runs/default/report.md
# and its plots (about 2 minutes on 2 cores)
RUN_ARGS ?= --methods identity,bf16,powersgd,topk,dasgd --steps 600 --link 10gbit,10us --link 1gbit,50us \
	--link 100mbit,1ms --out runs/default --overwrite

run: $(STAMP)
	$(VENV)/bin/thinwire compare $(RUN_ARGS)

# the tests run after lint (ruff: style, import order, likely bugs) and types (mypy on src/thinwire);
# both are configured in pyproject.toml
test: lint
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build src/*.egg-info
