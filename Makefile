# `make demo` and `make test` each create/refresh .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvmesh-installed
TORCH := torch==2.13.0

.PHONY: demo test lint bench protos venv clean

venv: $(STAMP)

# torch goes in first and pinned: an unpinned torch pulled in by a dependency is a
# multi-GB CUDA build. Re-runs when pyproject.toml changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

demo: venv
	$(VENV)/bin/kvmesh demo --out-dir results/demo

test: venv lint
	$(PY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

protos: venv
	$(PY) protos/generate.py

bench: venv
	$(VENV)/bin/kvmesh bench kvcache --out results/bench_kvcache.json
	$(VENV)/bin/kvmesh bench engine --out results/bench_engine.json
	$(VENV)/bin/kvmesh bench index --out results/bench_index.json
	$(VENV)/bin/kvmesh bench router --out results/bench_router.json

clean:
	rm -rf $(VENV) results .pytest_cache .ruff_cache .hypothesis
