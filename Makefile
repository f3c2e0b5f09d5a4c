# One line per target, each calling a real command. Pins: requirements.txt (the one place).
# `make` alone lists the targets (make help).
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(abspath $(VENV))/bin/python
STAMP := $(VENV)/.cutedsl-pins-$(shell sha256sum requirements.txt | cut -c1-16)
IMAGE ?= dsv4-nvfp4-cutedsl:vllm0.21.0
MODEL ?=
PYTEST_ARGS ?=

.PHONY: help setup test test-cpu test-gpu lint format diff patch-check patch-revert check-kernels serve build run bench

help:   ## list the targets (this text)
	@echo "Targets (VENV=$(VENV); MODEL, PYTEST_ARGS, IMAGE as variables):"
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-zA-Z_-]+):.*## (.*)$$/  \1\t\2/' | expand -t 18

setup: $(STAMP)   ## venv with the pins + this project (editable) + the vLLM overlay applied
	PYTHON=$(PY) bash apply_patches.sh

$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.txt
	rm -f $(VENV)/.cutedsl-pins-* && touch $@

test: setup lint   ## what CI runs: lint, then every CPU test (GPU tests skip with the reason)
	$(PY) -m pytest -q $(PYTEST_ARGS) tests   # gpu/sm90/sm100 tests collect and skip with the reason (tests/conftest.py)

test-cpu: test   ## the same as test

test-gpu: setup   ## on a GPU machine: the GPU tests only; fails when no GPU test ran
	$(PY) -m pytest -q -m "gpu or sm90 or sm100" --require-gpu-tests $(PYTEST_ARGS) tests

lint:   ## ruff check + ruff format --check (config in pyproject.toml)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

format:   ## ruff check --fix + ruff format
	$(PY) -m ruff check --fix . && $(PY) -m ruff format .

diff: $(STAMP)   ## our overlays against the pristine upstream files (review this, not whole files)
	@PYTHON=$(PY) bash apply_patches.sh --diff

patch-check:   ## is the vLLM overlay applied? (exit 0 applied, 1 not, 2 drifted)
	PYTHON=$(PY) bash apply_patches.sh --check

patch-revert:   ## restore vLLM's pristine files byte for byte
	PYTHON=$(PY) bash apply_patches.sh --revert

check-kernels: setup   ## compile every CuTeDSL kernel for sm_90a and sm_100a (no GPU) and check PTX/SASS
	$(PY) -m cutedsl.tools.check_kernels

serve: setup   ## serve MODEL (default: the tiny generated full-NVFP4 checkpoint)
	PYTHON=$(PY) bash scripts/serve.sh $(MODEL)

build:   ## the Docker image (FROM vllm/vllm-openai:v0.21.0, overlay applied at build time)
	docker build -t $(IMAGE) .

run:   ## serve MODEL (a host directory) from the image on all GPUs (JIT caches kept in volumes)
	docker run --rm --gpus all --ipc=host -p 8000:8000 -v dsv4-tilelang-cache:/root/.tilelang \
		-v dsv4-vllm-cache:/root/.cache/vllm -v dsv4-cutedsl-cache:/root/.cache/cutedsl -v dsv4-triton-cache:/root/.triton $(if $(MODEL),-v $(abspath $(MODEL)):/model:ro -e MODEL=/model) $(IMAGE)

bench: setup   ## kernel benchmarks (GPU)
	$(PY) -m cutedsl.bench
