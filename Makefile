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

# the embedded default (mnist1d, identity, 2 local workers), with its cost on three links
RUN_ARGS ?= --link 10gbit,10us --link 1gbit,50us --link 100mbit,1ms --out runs/default --overwrite

run: $(STAMP)
	$(VENV)/bin/thinwire train $(RUN_ARGS)

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
