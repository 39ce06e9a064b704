# Two commands do all set-up on a fresh clone: `make demo` and `make test`.
# torch is installed first and pinned, so pip never pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	touch $@

# The demo shows every capability, so it installs the extras its steps need.
DEMO_EXTRAS ?= serve,sign

$(VENV)/.demo: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install --quiet -e '.[$(DEMO_EXTRAS)]'
	touch $@

$(VENV)/.dev: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install --quiet -e '.[dev,all]'
	touch $@ $(VENV)/.demo

# The crash tests kill saves at each rename with strace; without it they skip, saying so.
$(VENV)/.strace: | $(BIN)/python
	command -v strace >/dev/null || (apt-get update -qq && apt-get install -y -qq strace) \
		|| echo "strace could not be installed: the rename-window crash tests will skip"
	touch $@

demo: $(VENV)/.demo
	$(BIN)/torchverity demo

test: $(VENV)/.dev $(VENV)/.strace
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

# The pickle-scanner baselines live outside the venv: they are benchmark-only.
benchmarks/_work/scanners:
	$(BIN)/python -m pip install --quiet --target $@ picklescan modelscan

bench: $(VENV)/.dev benchmarks/_work/scanners
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
