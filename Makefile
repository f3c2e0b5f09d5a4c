# One line per target, each calling a real command. Pins: requirements.txt (the one place).
SHELL := /bin/bash
VENV ?= .venv
PY := $(abspath $(VENV))/bin/python
STAMP := $(VENV)/.cutedsl-pins-$(shell sha256sum requirements.txt | cut -c1-16)
IMAGE ?= dsv4-nvfp4-cutedsl:vllm0.21.0
MODEL ?=
PYTEST_ARGS ?=

.PHONY: setup test test-cpu test-gpu lint format diff patch-check patch-revert check-kernels serve build run bench

setup: $(STAMP)   ## venv with the pins + this project (editable) + the vLLM overlay applied
	PYTHON=$(PY) bash apply_patches.sh

$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	rm -f $(VENV)/.cutedsl-pins-* && touch $@

test: setup lint   ## what CI runs: lint, then every CPU test (GPU tests skip with the reason)
	$(PY) -m pytest -q $(PYTEST_ARGS) tests   # gpu/sm90/sm100 tests collect and skip with the reason (tests/conftest.py)

test-cpu: test

test-gpu: setup   ## on a GPU machine: the GPU tests only (SM100 ones skip on Hopper and vice versa)
	$(PY) -m pytest -q -m "gpu or sm90 or sm100" $(PYTEST_ARGS) tests

lint:
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

format:
	$(PY) -m ruff check --fix . && $(PY) -m ruff format .

diff: $(STAMP)   ## our overlays against the pristine upstream files (review this, not whole files)
	@PYTHON=$(PY) bash apply_patches.sh --diff

patch-check:
	PYTHON=$(PY) bash apply_patches.sh --check

patch-revert:
	PYTHON=$(PY) bash apply_patches.sh --revert

check-kernels: setup   ## compile every CuTeDSL kernel for sm_90a and sm_100a (no GPU) and check PTX/SASS
	$(PY) -m cutedsl.tools.check_kernels

serve: setup   ## serve MODEL (default: the tiny generated full-NVFP4 checkpoint)
	PYTHON=$(PY) bash scripts/serve.sh $(MODEL)

build:   ## the Docker image (FROM vllm/vllm-openai:v0.21.0, overlay applied at build time)
	docker build -t $(IMAGE) .

run:   ## serve MODEL (a host directory) from the image on all GPUs (JIT caches kept in volumes)
	docker run --rm --gpus all --ipc=host -p 8000:8000 -v dsv4-tilelang-cache:/root/.tilelang \
		-v dsv4-vllm-cache:/root/.cache/vllm $(if $(MODEL),-v $(abspath $(MODEL)):/model:ro -e MODEL=/model) $(IMAGE)

bench: setup   ## kernel benchmarks (GPU)
	$(PY) -m cutedsl.bench
