# Two commands set everything up on a fresh Debian machine:
#   make demo   runs the main job        make test   runs the test suite
# Re-running skips what is already done. On a machine with an NVIDIA GPU,
#   make gpu-check   runs the GPU-marked tests and bench/gpu.py (see that target).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a GPU machine override, e.g. TORCH_SPEC='torch==2.13.0'
# with your CUDA index configured for pip.
TORCH_SPEC ?= torch==2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
MANIM_DEBS := libcairo2-dev libpango1.0-dev pkg-config
BROWSER_DEBS := chromium

.PHONY: setup test demo lint format bench samples docs docs-bench pictures system-deps \
	browser-deps plotly-js clean gpu-check gpu-check-run

setup: system-deps $(VENV)/.installed plotly-js

# Debian packages, installed only when missing.
system-deps:
	@missing=""; for p in $(MANIM_DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "==> installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; fi

browser-deps:
	@missing=""; for p in $(BROWSER_DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; fi

# plotly.js's cartesian bundle for the dashboard, which Chromium starts in half the time of
# the full one (dashboard/plotly_bundle.py): fetched with npm at the version the installed
# plotly ships, checked against the integrity pinned there, kept in dashboard/plotly_js/
# (ignored by git). Quick when it is there; without npm or a network it says so and the
# dashboard serves the full bundle. Run after a venv stamp (it needs plotly installed).
plotly-js:
	@$(PY) -m knapformer.dashboard.plotly_bundle

# Set-up takes minutes on a fresh clone (torch alone ~100 s): each step says what it does
# and pip shows its progress. Two stamps: `make demo` installs what the demo needs (the
# readers: '.[all]'), `make test` that and the test tools ('.[dev]'); neither stamp stands
# in for the other, so either command works first on a fresh clone.
$(VENV)/.torch:
	@echo "==> [1/3] creating the virtual environment $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@echo "==> [2/3] installing $(TORCH_SPEC) (about 2 minutes)"
	$(PY) -m pip install --progress-bar on "$(TORCH_SPEC)"
	@touch $@

$(VENV)/.installed-all: pyproject.toml $(VENV)/.torch
	@echo "==> [3/3] installing knapformer with the readers (dashboard, animation, TensorBoard)"
	$(PY) -m pip install --progress-bar on -e '.[all]'
	@touch $@
	@echo "==> set-up done"

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	@echo "==> [3/3] installing knapformer with the readers and the test tools"
	$(PY) -m pip install --progress-bar on -e '.[dev]'
	@touch $@
	@echo "==> set-up done"

# Three pytest workers, one test file each at a time (--dist loadfile: a file's tests share
# their fixtures and folders). Much of the suite waits (worker start-up, a browser, a
# deadline, a fault's timeout): with three workers on 2 cores it took 7.8 minutes for
# 1,708 tests (docs pages run side by side, the longest files first: tests/suite_order.py).
# The suite starts hundreds of Python processes (ranks, the CLI, docs blocks): Python writes
# its bytecode caches (__pycache__, ignored by git) for them even where the environment says
# PYTHONDONTWRITEBYTECODE, else each one compiles the modules it imports again (about a
# tenth of a CLI test file's CPU).
TEST_WORKERS ?= 3
test: system-deps browser-deps $(VENV)/.installed plotly-js
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The live demo: 8 CPU workers train a toy DiT with the balancer, record every plan to
# runs/demo/plans.jsonl and serve the dashboard on http://127.0.0.1:8050 (Ctrl-C stops).
demo: system-deps $(VENV)/.installed-all plotly-js
	@echo "==> starting the demo (Ctrl-C stops; DEMO_ARGS=... passes options)"
	$(VENV)/bin/knapformer demo $(DEMO_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(VENV)/.installed
	$(PY) bench/planner.py

# Every command output shown in README.md and docs/*.md is written by docs/make_docs.py
# (tests/test_docs.py fails when one is stale). docs-bench re-runs the benchmarks behind
# docs/performance.md (several minutes; run it on an idle machine).
docs: system-deps browser-deps $(VENV)/.installed
	$(PY) docs/make_docs.py

docs-bench: system-deps browser-deps $(VENV)/.installed
	$(PY) docs/make_docs.py --bench

pictures: system-deps browser-deps $(VENV)/.installed
	$(PY) docs/make_pictures.py

# The GPU check, for one CUDA GPU (well under 10 minutes on an H100): the GPU-marked
# tests, `knapformer calibrate --benchmark` (a FLUX-sized block timed and fitted), then
# bench/gpu.py (also when a test failed), whose figures (gpu-check.json,
# workload-fit.html, plans.jsonl) go to GPU_CHECK_OUT. Without a GPU it says that it
# needs CUDA and exits 0.
# GPU_PY is the Python it runs with: by default the project's venv, set up as for
# `make test` (TORCH_SPEC picks a CUDA build of torch); on a machine whose Python already
# has a CUDA torch and the project's dependencies (offline, say), name it:
#   make gpu-check GPU_PY=python3 GPU_CHECK_OUT=/some/folder
GPU_PY ?= $(PY)
GPU_CHECK_OUT ?= runs/gpu-check
# Another Python gets the project installed here (the readers install as knapformer.*
# packages, which a plain source tree on PYTHONPATH does not give), without dependencies.
GPU_SITE ?= runs/gpu-site
GPU_TESTS := $(wildcard tests/test_*_gpu.py)

gpu-check:
	@if nvidia-smi -L >/dev/null 2>&1 || ls /dev/nvidia[0-9]* >/dev/null 2>&1; then \
	  $(MAKE) --no-print-directory gpu-check-run; \
	else echo "gpu-check skipped: it needs CUDA, and this machine has no NVIDIA GPU"; fi

# Reached only where a GPU was seen. The venv is set up only when GPU_PY is its Python.
gpu-check-run: $(if $(filter $(PY),$(GPU_PY)),system-deps $(VENV)/.installed)
	@cuda=$$($(GPU_PY) -c 'import torch; print(int(torch.cuda.is_available()))') || exit 1; \
	if [ "$$cuda" != 1 ]; then $(GPU_PY) bench/gpu.py; exit 0; fi; \
	site="$(CURDIR)"; if [ "$(GPU_PY)" != "$(PY)" ]; then \
	  echo "==> installing the project (no dependencies) into $(GPU_SITE) for $(GPU_PY)"; \
	  rm -rf "$(GPU_SITE)" && $(GPU_PY) -m pip install -q --no-deps --no-build-isolation \
	    --no-index --target "$(GPU_SITE)" . || exit 1; site="$(abspath $(GPU_SITE))"; fi; \
	export PYTHONPATH="$$site$${PYTHONPATH:+:$$PYTHONPATH}" GPU_CHECK_OUT="$(GPU_CHECK_OUT)"; \
	tests=0; $(GPU_PY) -P -m pytest -q -p no:cacheprovider -m gpu $(GPU_TESTS) || tests=$$?; \
	$(GPU_PY) -P -c 'import sys; from knapformer.cli import main; sys.exit(main(sys.argv[1:]))' calibrate --benchmark || tests=$$?; \
	$(GPU_PY) bench/gpu.py || exit $$?; exit $$tests

samples: $(VENV)/.installed
	$(PY) sample_plans/make_samples.py
	$(VENV)/bin/knapformer demo --steps 30 --no-dashboard --out runs/demo-sample
	cp runs/demo-sample/plans.jsonl sample_plans/demo.jsonl

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis media runs dashboard/plotly_js
