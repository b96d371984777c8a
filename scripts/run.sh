#!/usr/bin/env bash
# `make run`'s last step: the production app server on loopback, plus — when no cluster is
# configured (the embedded stand-in) — the demo workload and an in-process reconciler, so the
# whole flow can be watched on the dashboard. Everything stops together on Ctrl-C / SIGTERM.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PORT=${PORT:-8000}

mode=$($PY manage.py shell -c "from django.conf import settings; print(settings.TESSERA['KUBE_MODE'])" 2>/dev/null | tail -1)
pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

if [ "$mode" = "embedded" ]; then
  echo "run: no cluster configured: embedded Kubernetes stand-in, demo workload and reconciler"
  $PY manage.py reconcile --loop &
  pids+=($!)
  # Simulated pods go through the real extender endpoints over HTTP (waits for /healthz).
  $PY manage.py demo --url "http://127.0.0.1:$PORT" &
  pids+=($!)
else
  echo "run: cluster mode '$mode': start the reconciler with 'make worker' and 'make beat'"
fi

echo "run: serving http://127.0.0.1:$PORT (admin at /admin/)"
.venv/bin/gunicorn controlplane.wsgi --bind "127.0.0.1:$PORT" --workers 2 --threads 4 \
  --access-logfile - --graceful-timeout 10 &
server=$!
pids+=($server)
# The server is the main job: when it stops, everything stops. A helper that dies (its error
# is on the terminal) leaves the server up.
wait "$server"
