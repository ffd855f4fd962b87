# Two commands a new user needs: `make quickstart` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow lint quickstart clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(PY) -m ruff check bft_lightning tests bench examples
	$(PY) -m ruff format --check bft_lightning tests bench examples
	$(PY) -m mypy bft_lightning
	$(VENV)/bin/hadolint docker/Dockerfile

test: lint
	$(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

quickstart: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m bft_lightning.quickstart

clean:
	rm -rf $(VENV) lightning_logs .pytest_cache .mypy_cache .ruff_cache
