VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: setup test demo lint bench clean

$(PY):
	python3 -m venv $(VENV)

# torch first, pinned: the CPU build lies on local disk; a range would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

test: setup
	$(VENV)/bin/ruff check linearformers tests benchmarks examples
	$(PY) -m pytest -x -q tests

demo: setup
	$(PY) -m linearformers.demo
	$(PY) -m linearformers.training.demo

lint: setup
	$(VENV)/bin/ruff check linearformers tests benchmarks examples
	$(VENV)/bin/ruff format --check linearformers tests benchmarks examples

bench: setup
	$(PIP) install -q -e ".[bench]"
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) outputs build *.egg-info
