VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: setup test demo data kernels lint bench clean

$(PY):
	@echo "== creating the virtual environment $(VENV) =="
	python3 -m venv $(VENV)

# torch first, pinned: the CPU build lies on local disk; a range would pull a multi-GB CUDA build.
# A few minutes on a fresh clone; pip prints each package as it goes.
$(STAMP): $(PY) pyproject.toml
	@if $(PY) -c "import torch" 2>/dev/null; then \
		echo "== torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)') =="; \
	else \
		echo "== installing torch 2.13.0 (CPU build) =="; \
		$(PIP) install torch==2.13.0; \
	fi
	@echo "== installing linearformers (editable) with [dev]: transformers, datasets, accelerate, pytest, ruff, ... =="
	$(PIP) install -e ".[dev]"
	@touch $(STAMP)
	@echo "== setup done: activate with 'source $(VENV)/bin/activate', or call $(VENV)/bin/python directly =="

setup: $(STAMP)

# Two workers by default (pytest-xdist): on 2 cores, about half the suite's wall time of one. WORKERS=0 runs it in
# this process, one test at a time.
WORKERS ?= 2

test: setup
	$(VENV)/bin/ruff check linearformers tests benchmarks examples
	$(PY) -m pytest -x -q -n $(WORKERS) tests

demo: setup
	$(PY) -m linearformers.training.demo

# The README's training commands read these: train.txt / validation.txt (Python standard-library source) and
# train.csv / validation.csv (its lines labelled comment / code), written into the repository root.
data: setup
	$(PY) -m linearformers.training.demo --data-only --data-dir .

kernels: setup
	$(PY) benchmarks/kernel_speed.py

lint: setup
	$(VENV)/bin/ruff check linearformers tests benchmarks examples
	$(VENV)/bin/ruff format --check linearformers tests benchmarks examples

bench: setup
	$(PIP) install -e ".[bench]"
	$(PY) benchmarks/attention.py

clean:
	rm -rf $(VENV) outputs build *.egg-info train.txt validation.txt train.csv validation.csv
