# The two commands of the README: `make train` (the main job) and `make test` (the suite).
# Each creates the virtualenv on first use. TORCH_SPEC pins the CPU wheel that is on our
# machines; on a CUDA machine pass e.g. TORCH_SPEC='torch==2.13.0' with a CUDA index.
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: train test test-ray lint bench gpu-check gpu-throughput clean

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

# Two processes, a test file in one (tests/e2e/conftest.py `once`: their shared runs made once):
# about 75% of 2 cores is busy in one process, the rest is waits on timeouts and start-ups.
test: lint
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile --durations=15 tests

# Both Ray Train recipes of docs/clusters.md under real ray[train] (TorchTrainer, 2 CPU
# workers): about a minute, so a trial beside the suite, not in it.
test-ray: $(VENV)/.installed
	$(VENV)/bin/pip install -q -e '.[ray]'
	DATAPARALLEL_TEST_RAY=1 $(VENV)/bin/python -m pytest -q -s tests/e2e/test_ray.py

bench: $(VENV)/.installed
	$(VENV)/bin/python benchmarks/bench_step.py $(ARGS)

# The GPU check (benchmarks/gpu_check.py) on a machine with one NVIDIA GPU, run by the Python
# that already holds a CUDA build of torch (2.11 or later): nothing is installed, this checkout's
# src/ is put on the path. It ends within about 5 minutes (--budget) and writes its table to
# gpu_check.md, rewritten after each section (ARGS="--out FILE" elsewhere).
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR)/src:$$PYTHONPATH $(GPU_PYTHON) benchmarks/gpu_check.py $(ARGS)

# Issue 40's throughput run (benchmarks/gpu_throughput.py) on the same machine, the same way: a
# Llama 3.2 1B at sequence 2048 under the bound, PyTorch DDP and FSDP2, the Hugging Face
# Trainer, our API and our job (tokens/s, MFU, the CUDA peak against the plan's), AdamW's
# step alone, and a LoRA fine-tune of a random Llama 3 8B; within --budget (330 s), the table
# rewritten to gpu_throughput.md after each contender (ARGS="--out FILE --json FILE").
gpu-throughput:
	PYTHONPATH=$(CURDIR)/src:$$PYTHONPATH $(GPU_PYTHON) benchmarks/gpu_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
