# One virtual environment inside the checkout; torch 2.13.0 is installed first so that pip
# never resolves torch to a multi-GB CUDA build. Where pip does not already find the CPU
# wheel (PIP_FIND_LINKS on the project's machines), name its index:
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
VENV ?= .venv
TORCH_INDEX ?=
PY := $(VENV)/bin/python
export EDGEPFL_DATA ?= $(abspath ../shared/data)

.PHONY: setup demo test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/edgepfl run

lint: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

# The tests that compare two computations within a float tolerance (marked tolerance, in
# these files) run once more on AVX2 kernels, so that a tolerance that holds only on an
# AVX-512 machine (or only on an AVX2 one) fails on either kind
# (torch.compile's tests stay out: forced AVX2 kernels beside inductor give NaN losses on
# an AVX-512 CPU, a mismatch of the two, not of our code)
SENSITIVE := tests/test_batch_clients.py tests/test_workers.py tests/test_golden.py \
	tests/test_kapc.py tests/test_dcpfl.py tests/test_lgfedavg.py

# one test process per core (pytest-xdist), each test on one torch thread (tests/conftest.py):
# the suite's tiny models gain nothing from a second thread, and a second process halves
# the time; worksteal hands a process that ran out the tests another still has queued
PARALLEL := -n auto --dist worksteal

test: lint
	$(VENV)/bin/pytest $(PARALLEL)
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(VENV)/bin/pytest -q $(PARALLEL) \
		-m tolerance $(SENSITIVE)

bench: setup
	$(PY) bench/speed/throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
