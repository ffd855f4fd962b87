# Two commands a new user needs: `make quickstart` (the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test test-slow lint quickstart clean FORCE

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# the torch build asked for: a changed TORCH_SPEC re-runs the install
SPEC_FILE := $(VENV)/.torch-spec
$(SPEC_FILE): FORCE | $(PY)
	@echo "$(TORCH_SPEC)" | cmp -s - $@ || echo "$(TORCH_SPEC)" > $@

FORCE:

$(STAMP): $(PY) pyproject.toml $(SPEC_FILE)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,tune,serve]"
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

# configs/experiments/<backbone>_<precision>_<dataset>.yaml from the table configs/grid.yaml
.PHONY: configs
configs: setup
	$(PY) bench/experiment_grid.py
