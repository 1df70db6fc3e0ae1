# Two entry points do all set-up on a fresh machine: `make demo` (the local TrainingJob) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

# torch is pinned in the same pip command so pip takes the CPU wheel instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q "torch==2.13.0" -e ".[dev]"
	touch $(STAMP)

.PHONY: install services demo test test-exhaustive lint format generate

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/wanloom validate jobs/tiny-local.yaml
	$(VENV)/bin/wanloom run jobs/tiny-local.yaml

# The end-to-end tests start a real Prometheus on 127.0.0.1; Debian ships it.
services:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
	  echo "prometheus is not installed: the Prometheus end-to-end test will be skipped"

test: $(STAMP) services
	$(PY) -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

# The kernels' full D x N x B x modulation x dtype grid in the interpreters: too slow for every CI run.
test-exhaustive: $(STAMP)
	$(PY) -m pytest -n 2 --dist load -m exhaustive tests/trainer/kernels

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

# Regenerate the files derived from the typed API (tests fail when these drift).
generate: $(STAMP)
	$(VENV)/bin/wanloom crd --chart helm/wanloom
	$(VENV)/bin/wanloom docs > docs/trainingjob.md
