# kvmesh — the two commands a user needs are `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.kvmesh-setup

.PHONY: setup test run lint protos bench clean

setup: $(STAMP)

# Idempotent: installs redis-server if missing, creates .venv, installs the CPU torch first
# (so pip never pulls a CUDA build), then this project editable with its dev extras.
$(STAMP): pyproject.toml
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server with apt"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[dev]"
	@touch $(STAMP)

test: setup
	$(PY) -m pytest -q tests

run: setup
	bash scripts/demo.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(PY) scripts/lint_imports.py

protos: setup
	$(PY) -m kvmesh.protogen

bench: setup
	$(PY) benchmarks/kv_service_bench.py
	$(PY) benchmarks/router_overhead.py
	$(PY) benchmarks/engine_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
