# Quick start: `make demo` and `make test`. Both create or refresh .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROFILE ?= quick
# torch is installed on its own first, pinned, so that nothing later pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: setup demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# speculators (dev/tests only) declares torchvision/torchaudio, which clash with the torch pin: it is
# installed with --no-deps, its light runtime deps are in the dev extra.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip install --quiet --no-deps speculators==0.9.0
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/onboard demo --profile $(PROFILE)

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check onboard tests
	$(BIN)/ruff format --check onboard tests

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
