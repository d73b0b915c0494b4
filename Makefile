# Set-up on a fresh machine: `make demo` runs the main job, `make test` the test suite.
# Both create .venv on first use. TORCH pins the torch wheel installed before the package, so that
# nothing later replaces it (here: the CPU wheel on disk; on a GPU machine the same pin gets CUDA).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fedshard demo

test: $(STAMP)
	$(BIN)/python -m pytest -q
