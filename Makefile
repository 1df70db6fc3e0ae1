# Two entry points do all set-up on a fresh machine: `make demo` (the local TrainingJob) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

# Every version comes from .ci/constraints.txt, so a fresh clone tests what the images ship, whatever PyPI released since.
$(STAMP): pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -c .ci/constraints.txt -e ".[dev]"
	touch $(STAMP)

.PHONY: install services cluster cluster-down images demo test test-exhaustive lint format generate

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/wanloom validate jobs/tiny-local.yaml
	$(VENV)/bin/wanloom run jobs/tiny-local.yaml

# The end-to-end tests start a real Prometheus on 127.0.0.1; Debian ships it.
services:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
	  echo "prometheus is not installed: the Prometheus end-to-end test will be skipped"

# A real control plane on 127.0.0.1 (etcd, kube-apiserver, controller manager, scheduler, JobSet, KWOK fake nodes),
# built from Go modules by .ci/cluster/build.sh and cached per version; writes .cluster/kubeconfig.
cluster: $(STAMP)
	$(PY) .ci/cluster/up.py

cluster-down:
	$(PYTHON) .ci/cluster/down.py

# The operator and JAX trainer images from trainer_images/Dockerfile.* with buildah (no Docker daemon), on a
# Debian-built stand-in for their Python base (.ci/images/build.sh); IMAGES="operator tpu gpu" adds the GPU image.
IMAGES ?= operator tpu
images:
	.ci/images/build.sh $(IMAGES)

# The tests that need neither the cluster nor the images run while both build in the background; then the control
# plane starts (left running for the next run; `make cluster-down` stops it) and the rest run (.ci/test.sh). Where
# a build or the cluster fails, its tests skip; under WANLOOM_REQUIRE_IMAGES=1 and WANLOOM_REQUIRE_E2E=1 (CI) the
# run stops there, with the build's log or up.py's error.
test: $(STAMP) services
	PY=$(PY) IMAGES="$(IMAGES)" PYTEST_ARGS="$(PYTEST_ARGS)" .ci/test.sh

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
