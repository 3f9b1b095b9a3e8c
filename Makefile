# acoll — `make demo`, `make test` and `make test-mpi` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: demo test test-mpi test-gpu test-rdma lint bench bench-netns venv native clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,lint,plot]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

demo: native
	@echo "== acoll demo: 4 local ranks (acoll-run), bootstrap + barrier + all-reduce =="
	$(BIN)/acoll-run -n 4 -- $(BIN)/python examples/allreduce_demo.py
	@echo "== acoll-perf all_reduce sweep, 4 ranks on localhost =="
	$(BIN)/acoll-perf all_reduce -N 4 -b 8 -e 16M -f 8 -n 10 -w 3 -d float32 -o sum

# The native ring (src/acoll/_native/ring.c) is built once with the system's C compiler
# into ~/.cache/acoll; without one, acoll runs its Python ring and the tests that need the
# C code say why they skip.
native: venv
	@$(BIN)/python -m acoll._native || echo "native ring unavailable: the Python ring runs"

# Two workers (pytest-xdist): most tests use one core; network-namespace tests share a worker.
test: native
	$(BIN)/python -m pytest -n 2 --dist loadgroup

# Open MPI (Debian's) and mpi4py, then the tests under a real mpirun (tests/test_mpi.py).
# Idempotent and quick once installed; works as root with no stdin (CI) or through sudo.
# ACOLL_TEST_MPI=1 turns the tests' "mpirun/mpi4py missing" skips into failures.
test-mpi: venv
	@if command -v mpirun >/dev/null 2>&1 && \
	    dpkg -s openmpi-bin libopenmpi-dev >/dev/null 2>&1; then \
	  echo "test-mpi: Open MPI already installed"; \
	else \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    openmpi-bin libopenmpi-dev </dev/null; \
	fi
	@$(BIN)/python -c "import mpi4py" 2>/dev/null || \
	  $(BIN)/python -m pip install -q -e '.[test,lint,plot,mpi]'
	ACOLL_TEST_MPI=1 $(BIN)/python -m pytest -m mpi tests/test_mpi.py

# RDMA on a real device (InfiniBand, RoCE, or soft-RoCE rxe): the transport conformance
# battery and a 2-rank all_reduce over real pyverbs (tests/test_rdma_hw.py); without an
# active port every test is skipped, with the reason shown. pyverbs must match the system's
# libibverbs, so it comes from the distribution (Debian's python3-pyverbs, installed here as
# test-mpi installs Open MPI) and is made visible to the venv; PyPI's pyverbs builds its own
# rdma-core and loads only against that same version. The verbs test double runs the
# transport in `make test`.
PYVERBS_SYSTEM ?= /usr/lib/python3/dist-packages
test-rdma: venv
	@if ! $(BIN)/python -c "import pyverbs" 2>/dev/null; then \
	  if [ ! -d $(PYVERBS_SYSTEM)/pyverbs ] && command -v apt-get >/dev/null 2>&1; then \
	    sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pyverbs \
	      </dev/null || echo "test-rdma: python3-pyverbs could not be installed"; \
	  fi; \
	  if [ -d $(PYVERBS_SYSTEM)/pyverbs ]; then \
	    mkdir -p $(VENV)/system-pyverbs && \
	    ln -sfn $(PYVERBS_SYSTEM)/pyverbs $(VENV)/system-pyverbs/pyverbs && \
	    echo "$(abspath $(VENV))/system-pyverbs" > "$$($(BIN)/python -c \
	      'import sysconfig; print(sysconfig.get_paths()["purelib"])')/system-pyverbs.pth"; \
	  fi; \
	fi
	$(BIN)/python -m pytest -rs tests/test_rdma_hw.py

# On a GPU host (no package registry): the host's own python3 with its CuPy/NumPy/msgpack/
# uvloop, plus pure-Python wheels carried in .whl/ (pytest, pytest-asyncio, ..., and an acoll
# wheel for its entry points; the code itself is imported from src/). Whole suite + GPU tests.
GPU_SITE ?= /tmp/acoll-site
test-gpu:
	@if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile \
	  --no-cache-dir --upgrade --target $(GPU_SITE) .whl/*.whl; fi
	PYTHONPATH=$(CURDIR)/src:$(GPU_SITE) PATH=$(GPU_SITE)/bin:$$PATH NCCL_NVLS_ENABLE=0 \
	  python3 -m pytest -p no:cacheprovider $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check src tests examples
	$(BIN)/mypy

bench: venv
	$(BIN)/python -m pip install -q 'torch==2.13.0'
	$(BIN)/python bench/run_bench.py

# Four "hosts" (network namespaces on one bridge, every link shaped by tc tbf to 10 Gbit/s):
# acoll and Gloo all_reduce busbw against the line rate (bench/netns_shaped.py). Root (or
# sudo) and iproute2 needed; everything it creates is removed when it ends.
bench-netns: venv
	$(BIN)/python -m pip install -q 'torch==2.13.0'
	sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo $(BIN)/python bench/netns_shaped.py --rate 10gbit -b 1M -e 256M -n 10 -w 3 --repeat 2 \
	    --out bench/results/netns_shaped_10g.txt

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
