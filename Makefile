# Two commands set everything up on a fresh Debian machine:
#   make demo   runs the main job        make test   runs the test suite
# Re-running skips what is already done.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; on a GPU machine override, e.g. TORCH_SPEC='torch==2.13.0'
# with your CUDA index configured for pip.
TORCH_SPEC ?= torch==2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
MANIM_DEBS := libcairo2-dev libpango1.0-dev pkg-config
BROWSER_DEBS := chromium

.PHONY: setup test demo lint format bench samples system-deps browser-deps clean

setup: system-deps $(VENV)/.installed

# Debian packages, installed only when missing.
system-deps:
	@missing=""; for p in $(MANIM_DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; fi

browser-deps:
	@missing=""; for p in $(BROWSER_DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; fi

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

test: system-deps browser-deps $(VENV)/.installed
	$(PY) -m pytest -q

demo: system-deps $(VENV)/.installed
	$(VENV)/bin/knapformer show "sample_plans/mixed8_g1n2+g2n1+g4n1.json"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(VENV)/.installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(VENV)/.installed
	$(PY) bench/planner.py

samples: $(VENV)/.installed
	$(PY) sample_plans/make_samples.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis media runs
