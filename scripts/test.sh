#!/usr/bin/env bash
# The whole suite, as `make test` and CI run it, each stage timed (scripts/stage.sh) and the table
# of them printed at the end, whatever the outcome. Stops at the first stage that fails.
#
# Every test runs once: the tiers that need no cluster on SQLite (pytest-xdist), the
# database tiers again on PostgreSQL, the end-to-end suite once in the harness's own set-up on
# PostgreSQL, the tests the Helm chart changes (chart mode, Kueue) once in chart mode, then the
# chart's install, the real node, chaos. The Go builds of the pinned Kubernetes binaries
# (e2e/build.sh, most of a cold run) start first, in the background, and overlap everything
# that needs no cluster; a warm run finds them built and waits for nothing (docs/testing.md).
#
#   scripts/test.sh            (make test; CI: .ci/run)
# Environment: E2E_CHART_VALUES (values files of the chart-mode stage), PODS and SEED (chaos),
# TESSERA_STAGE_TIMES (where the stage times go; default a temporary file).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
# The builds' cache lives outside the clone, shared by every clone on the machine (docs/e2e.md).
export TESSERA_E2E_CACHE=${TESSERA_E2E_CACHE:-/var/tmp/tessera-e2e-cache}
CHART_VALUES=${E2E_CHART_VALUES:-values-resources.yaml}
export TESSERA_STAGE_TIMES=${TESSERA_STAGE_TIMES:-$(mktemp -t tessera-stages.XXXXXX)}
# shellcheck source=stage.sh
. scripts/stage.sh
stage() { stage_run "$@"; }

build_log=$(mktemp -t tessera-go-build.XXXXXX)
build_pid=
kill_tree() {
  local child
  for child in $(pgrep -P "$1" || true); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
finish() {
  local rc=$?
  if [ -n "$build_pid" ]; then kill_tree "$build_pid"; fi
  stage_table
  exit $rc
}
trap finish EXIT

# Nothing of the suite's but the cluster stages needs these; a binary already in the cache
# costs nothing. Its output goes to a log, shown when a build fails.
stage "go builds (background)" e2e/build.sh >"$build_log" 2>&1 &
build_pid=$!
wait_for_builds() {
  if ! wait "$build_pid"; then
    build_pid=
    echo "the Go builds failed (e2e/build.sh):" >&2
    tail -n 40 "$build_log" >&2
    return 1
  fi
  build_pid=
  grep -E '^e2e-build: built ' "$build_log" || echo "(every binary was in the cache)"
}

stage "set-up: virtualenv" make -s venv
eval "$(scripts/services.sh up)"

stage "lint" make -s lint
stage "shim checks" make -s check-shim
stage "no-cluster tiers, SQLite" make -s test-unit
stage "database tiers, PostgreSQL" env DATABASE_URL="$TEST_POSTGRES_URL" \
  $PY -m pytest -n 3 --dist worksteal -q \
  -m database tests/ledger tests/api tests/access tests/dashboard tests/reconciler tests/extender \
  --ignore=tests/api/test_schemathesis.py
stage "images" env -u DATABASE_URL $PY -m pytest -q tests/images
stage "go builds: wait" wait_for_builds
stage "e2e, harness set-up, PostgreSQL" env -u DATABASE_URL -u TESSERA_E2E_CHART_VALUES \
  TESSERA_E2E_POSTGRES_URL="$TEST_POSTGRES_URL" $PY -m pytest -q -m e2e tests/e2e
stage "e2e, chart mode ($CHART_VALUES), PostgreSQL" env -u DATABASE_URL \
  TESSERA_E2E_CHART_VALUES="$CHART_VALUES" TESSERA_E2E_POSTGRES_URL="$TEST_POSTGRES_URL" \
  $PY -m pytest -q -m e2e tests/e2e/test_chart_mode.py tests/e2e/test_kueue.py
stage "chart: helm and install" env -u DATABASE_URL $PY -m pytest -q tests/deploy
stage "real node" env -u DATABASE_URL $PY -m pytest -q tests/realnode
stage "chaos (${PODS:-2000} pods)" env TESSERA_CHAOS_PODS="${PODS:-2000}" \
  TESSERA_CHAOS_SEED="${SEED:-}" $PY -m pytest -q -m chaos tests/chaos
