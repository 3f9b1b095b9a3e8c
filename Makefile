# acoll — `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test lint bench venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,lint,plot]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	@echo "== acoll demo: 4 local ranks (acoll-run), bootstrap + barrier + all-reduce =="
	$(BIN)/acoll-run -n 4 -- $(BIN)/python examples/allreduce_demo.py
	@echo "== acoll-perf all_reduce sweep, 4 ranks on localhost =="
	$(BIN)/acoll-perf all_reduce -N 4 -b 8 -e 16M -f 8 -n 10 -w 3 -d float32 -o sum

test: venv
	$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check src tests examples
	$(BIN)/mypy

bench: venv
	$(BIN)/python -m pip install -q 'torch==2.13.0'
	$(BIN)/python bench/run_bench.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
