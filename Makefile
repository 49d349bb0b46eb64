# One virtual environment inside the checkout; the CPU build of torch 2.13.0 is installed
# first so that pip never resolves torch to a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
export EDGEPFL_DATA ?= $(abspath ../shared/data)

.PHONY: setup demo test lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/edgepfl run

lint: setup
	$(VENV)/bin/ruff check src tests bench

test: lint
	$(VENV)/bin/pytest

bench: setup
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
