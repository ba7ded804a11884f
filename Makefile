# The README's two commands. Each does its own set-up on a fresh clone: a .venv with the package
# (editable) and its dev tools. torch is installed only when absent, so a user's own build is kept.
# PY: the interpreter the venv is made from (`make PY=... setup` chooses). By default `python3` where it has torch (your
# own build, kept below); else Debian's python3.11 (the lock's version) where the system has it with venv, else
# `python3`. Debian builds it with PGO and LTO and links it statically, and every process of a run (ranks, launcher,
# supervisor) starts by importing torch and transformers: a 2-rank 6-step run of the demo model took 17.5 CPU-s under
# it against 20.3 under a pyenv build of 3.11.7 (shared libpython, no --enable-optimizations), medians of 6 each.
PY ?= $(shell if python3 -c "import torch" 2>/dev/null; then echo python3; \
  elif /usr/bin/python3.11 -c "import ensurepip, venv" 2>/dev/null; then echo /usr/bin/python3.11; else echo python3; fi)
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-fast readme setup lock lock-check test-latest sync-check bytecode nbtest pytest browser-deps slurm-deps llama-deps clean-venv gpu-wheels gpu-check

setup: $(VENV)/.installed

# The test environment is locked: every package at the version in requirements/test.lock (compiled by `make lock` from
# setup.py's ranges and requirements/test.in), installed under it as pip constraints, so a fresh clone today and in a
# month gets the environment that passed. LOCKED=0 installs the newest versions inside the ranges (`make test-latest`).
# torch follows TORCH_SPEC (the lock's by default); a torch the venv already sees is kept and left out of the constraints.
LOCK := requirements/test.lock
LOCKED ?= 1
PIP_SPEC ?= pip==26.3
CONSTRAINTS := $(VENV)/constraints.txt

# A torch importable by $(PY) (a user's CUDA build, say) is reused through --system-site-packages.
$(VENV)/.installed: settings.ini setup.py $(wildcard $(LOCK))
	@if [ ! -x $(BIN)/python ]; then \
	  if $(PY) -c "import torch" 2>/dev/null; then $(PY) -m venv --system-site-packages $(VENV); \
	  else $(PY) -m venv $(VENV); fi; fi
	$(BIN)/python -m pip install -q "$(PIP_SPEC)"
	@if [ "$(LOCKED)" = 1 ]; then grep -v '^torch==' $(LOCK) > $(CONSTRAINTS); else : > $(CONSTRAINTS); fi
	@$(BIN)/python -c "import torch" 2>/dev/null && echo "torch present: keeping it" || \
	  $(BIN)/python -m pip install -q -c $(CONSTRAINTS) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[dev]'
	@touch $@

# Compiles the lock anew from the newest versions inside setup.py's ranges: run on purpose, then `make test`, commit.
lock: setup
	$(BIN)/pip-compile -q --extra dev --strip-extras --allow-unsafe --no-emit-index-url --no-emit-find-links \
	  --annotation-style line -o $(LOCK) setup.py requirements/test.in
	@echo "$(LOCK): $$(grep -c '==' $(LOCK)) pins; now: make test, and commit it if it passes"

# The environment equals the lock (pip's tools and the project aside; llama.cpp's binding may be missing: its tests skip).
lock-check: setup
	@if [ "$(LOCKED)" = 1 ]; then $(BIN)/python tools/lock_check.py $(LOCK) --may-lack llama-cpp-python diskcache; fi

# The suite against the newest releases inside setup.py's ranges, in a venv of its own: how an upstream change is found
# by someone who asked, not by CI (not part of `make test`).
test-latest:
	$(MAKE) VENV=.venv-latest LOCKED=0 test

demo: setup
	$(BIN)/ilab-nb demo

# The library must be exactly what the notebooks export.
sync-check: setup
	$(BIN)/nbdev_export
	@git diff --quiet -- ilab_nb && [ -z "$$(git status --porcelain -- ilab_nb)" ] || \
	  { echo "ilab_nb/ is out of step with nbs/: run nbdev_export and commit both"; git status --short -- ilab_nb; exit 1; }

# README.md is rendered from nbs/index.ipynb (tests/test_readme.py checks that it is current).
readme: setup
	$(BIN)/python tools/make_readme.py

# Every process of the suite (a run's supervisor, its ranks, its user-code workers, the CLI, the kernels) imports
# ilab_nb: its bytecode is compiled once here rather than in each of them, where PYTHONDONTWRITEBYTECODE keeps Python
# from caching it. Run after sync-check, which may rewrite the modules (a stale file is compiled again, in memory).
bytecode: setup
	@$(BIN)/python -m compileall -q ilab_nb tests

# The notebooks' checks make their scratch folders with tempfile (about 270 of them a run): they go into a temporary
# directory of this run's own, removed after, so that `make test` leaves none of them behind in /tmp.
nbtest: setup bytecode
	@t=$$(mktemp -d) && echo "nbdev_test --n_workers 2 (TMPDIR=$$t, removed after)" && \
	  TMPDIR=$$t $(BIN)/nbdev_test --n_workers 2; rc=$$?; rm -rf "$$t"; exit $$rc

# Debian chromium for the browser test (skipped with a reason where it cannot be had).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "chromium could not be installed: the browser test will skip"; }

# Debian's SLURM and munge for the two-node SLURM tests (tests/slurm_cluster.py starts the daemons; skipped with
# the reason where they cannot be had).
slurm-deps:
	@command -v sbatch >/dev/null 2>&1 && command -v slurmd >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || \
	  { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; } || \
	  echo "slurm-wlm and munge could not be installed: the SLURM tests will skip"; }

# llama.cpp's Python binding for the GGUF tests' second reader: PyPI has only its source, a C++ build of many minutes on
# 2 cores, done once per machine (pip keeps the wheel it built in its cache; later venvs install that in seconds). The
# tests skip, saying why, when it cannot be had. A portable build: no -march=native.
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
llama-deps: setup
	@$(BIN)/python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	  timeout 1800 $(BIN)/python -m pip install -q -c $(CONSTRAINTS) "$(LLAMA_CPP_SPEC)" || echo "llama-cpp-python could not be built: the llama.cpp checks will skip"

# On both cores: two pytest-xdist workers; the tests sharing a run, a JupyterLab or the SLURM cluster stay on one
# (tests/conftest.py's SHARED_BY). TEST_WORKERS=0 runs them in this one process.
TEST_WORKERS ?= 2
pytest: setup bytecode browser-deps slurm-deps llama-deps lock-check
	$(BIN)/python -m pytest tests -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadgroup

test: sync-check nbtest pytest

# The checks that start no process (no run, command line, kernel, browser or cluster: the tests without the
# `processes` marker, which tests/conftest.py enforces) and the library's sync with the notebooks: a couple of minutes.
test-fast: sync-check bytecode
	$(BIN)/python -m pytest tests -q -ra -m "not processes" --durations=10 -n $(TEST_WORKERS) --dist loadgroup

# The GPU check (tools/gpu_check.py: CUDA tests, a short run of each CUDA option, bench/bench_gpu.py, one summary).
# The GPU machine to plan for has no network and lacks these packages, so their wheels are fetched here, for its
# Python, into an ignored folder that travels with the working tree; the versions are this venv's. bitsandbytes'
# wheel (43 MB, its CUDA kernels inside, tagged manylinux_2_24) is for the QLoRA stage: about 46 MB in all.
GPU_WHEELS := .gpu-wheels
GPU_PY_VERSION ?= 3.12
GPU_PKGS := pydantic pydantic_core annotated_types typing_inspection datasets dill multiprocess bitsandbytes

gpu-wheels: setup
	@rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PY_VERSION) --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 -d $(GPU_WHEELS) $$($(BIN)/python -c "import importlib.metadata as m; \
	  print(' '.join(f'{p}=={m.version(p)}' for p in '$(GPU_PKGS)'.split()))")
	@ls $(GPU_WHEELS)

# On the GPU machine, with its own Python and CUDA torch: the wheels into .gpu-site/, ilab_nb from the tree.
GPU_PY ?= python3
gpu-check:
	@if ls $(GPU_WHEELS)/*.whl >/dev/null 2>&1; then rm -rf .gpu-site && \
	  $(GPU_PY) -m pip install -q --no-index --no-deps --target .gpu-site $(GPU_WHEELS)/*.whl; fi
	PYTHONPATH=$(CURDIR):$(CURDIR)/.gpu-site $(GPU_PY) tools/gpu_check.py --out gpu-check
