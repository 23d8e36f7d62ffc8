# The two commands of the README: `make train` (the main job) and `make test` (the suite).
# Each creates the virtualenv on first use. TORCH_SPEC pins the CPU wheel that is on our
# machines; on a CUDA machine pass e.g. TORCH_SPEC='torch==2.13.0' with a CUDA index.
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: train test lint bench gpu-check clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q '$(TORCH_SPEC)'
	$(VENV)/bin/pip install -q -e '.[dev,hf]'
	touch $@

train: $(VENV)/.installed
	$(VENV)/bin/dataparallel train $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

test: lint
	$(VENV)/bin/python -m pytest -q --durations=15 tests

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/bench_step.py $(ARGS)

# The GPU check (benchmarks/gpu_check.py) on a machine with one NVIDIA GPU: its own venv with
# PyPI's torch 2.13.0 for Linux, which is the CUDA build (or wheels carried in .whl/ when the
# machine has no network: WHEELS=.whl), then one table of every CUDA/NCCL path.
GPU_VENV ?= .venv-gpu
WHEELS ?=
gpu-check:
	python3 -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install -q $(if $(WHEELS),--no-index --find-links $(WHEELS)) 'torch==2.13.0'
	$(GPU_VENV)/bin/pip install -q $(if $(WHEELS),--no-index --find-links $(WHEELS)) -e .
	$(GPU_VENV)/bin/python benchmarks/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) runs .pytest_cache
