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
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: setup
	$(VENV)/bin/edgepfl run

lint: setup
	$(VENV)/bin/ruff check src tests bench

test: lint
	$(VENV)/bin/pytest

bench: setup
	$(PY) bench/speed/throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
