# Set-up on a fresh machine: `make demo` runs the main job, `make test` the test suite.
# Both create .venv on first use. TORCH pins the torch wheel installed before the package, so that
# nothing later replaces it (here: the CPU wheel on disk; on a GPU machine the same pin gets CUDA).
# `make gpu-check` runs every GPU check with the machine's own $(PYTHON) and no venv (a GPU machine brings its
# torch build), in under 8 minutes; summary in $OUT or ./gpu-check; without CUDA it skips and exits 0.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test gpu-check

# setup.py builds the DynamiQ CPU kernels into the package: a changed source is rebuilt by the next `make test`
$(STAMP): pyproject.toml setup.py lightning_fedshard/dynamiq/cpu_kernels.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fedshard demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25

# PYTHON given on the command line, else the project's venv where there is one (here), else the machine's own
# python3 (the GPU machine's torch build)
GPU_PYTHON := $(if $(filter command line,$(origin PYTHON)),$(PYTHON),$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)))
gpu-check:
	PYTHON=$(GPU_PYTHON) bash scripts/gpu_check.sh
