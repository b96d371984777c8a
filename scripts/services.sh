#!/usr/bin/env bash
# Start (or reuse) the real services the test suite needs: PostgreSQL and Redis on loopback.
# Installs them from Debian's packages when absent. Idempotent; prints the URLs to use:
#   eval "$(scripts/services.sh up)"   -> exports TEST_POSTGRES_URL and REDIS_URL (and the
#                                         servers' pids, TESSERA_PG_PID and TESSERA_REDIS_PID)
#   scripts/services.sh down           -> stops what this script started
# A second pair beside the first (the chaos test's, which it stops and starts by pid): a folder
# and ports of its own in TESSERA_SERVICES_DIR, TESSERA_PG_PORT, TESSERA_REDIS_PORT;
# TESSERA_REDIS_PERSIST=1 keeps Redis's data across a restart (an append-only file in its folder).
set -euo pipefail

STATE=${TESSERA_SERVICES_DIR:-/var/tmp/tessera-services}
# Below Linux's ephemeral range (32768-60999 by default): a port in it can be taken at any
# moment as the local end of some outgoing connection (an etcd client's, say), and the server
# would then fail to start with "Address already in use".
PG_PORT=${TESSERA_PG_PORT:-25432}
REDIS_PORT=${TESSERA_REDIS_PORT:-26379}
# The database name in TEST_POSTGRES_URL: two checkouts testing at once on one machine each
# name their own (pytest-django creates test_<name> and drops it at the end).
PG_DB=${TESSERA_PG_DB:-tessera}
REDIS_PERSIST=${TESSERA_REDIS_PERSIST:-0}
log() { echo "services: $*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  log "installing $* from Debian's packages"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || true
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

pg_bin() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/pg_ctl" ] && { echo "$d"; return 0; }
  done
  return 1
}

pg_up() {
  local bin
  bin=$(pg_bin) || { apt_install postgresql; bin=$(pg_bin); }
  local data=$STATE/pg
  # PostgreSQL refuses to run as root: run it as the 'postgres' user the package creates.
  local runas=()
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    runas=(runuser -u postgres --)
  fi
  mkdir -p "$STATE"
  chmod 755 "$STATE"
  if [ ! -s "$data/PG_VERSION" ]; then
    rm -rf "$data"; mkdir -p "$data"
    [ "$(id -u)" = 0 ] && chown postgres "$data"
    "${runas[@]}" "$bin/initdb" -D "$data" -U postgres --auth=trust -E UTF8 >"$STATE/initdb.log" 2>&1 \
      || { cat "$STATE/initdb.log" >&2; exit 1; }
  fi
  if ! "$bin/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"; then
    # A server of this folder still up on another port (another port setting): stop it, the
    # folder is this script's own.
    if [ -s "$data/postmaster.pid" ]; then
      "${runas[@]}" "$bin/pg_ctl" -D "$data" -m fast stop >&2 2>/dev/null || true
    fi
    "${runas[@]}" "$bin/pg_ctl" -D "$data" -l "$data/server.log" -w -t 60 \
      -o "-p $PG_PORT -k $data -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200" \
      start >&2 || { tail -20 "$data/server.log" >&2; exit 1; }
  fi
  log "PostgreSQL ready on 127.0.0.1:$PG_PORT"
  echo "export TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:$PG_PORT/$PG_DB"
  echo "export TESSERA_PG_PID=$(head -1 "$data/postmaster.pid")"
}

redis_up() {
  command -v redis-server >/dev/null || apt_install redis-server
  mkdir -p "$STATE/redis"
  local appendonly=no
  [ "$REDIS_PERSIST" = 1 ] && appendonly=yes
  if ! redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; then
    local old
    old=$(cat "$STATE/redis/redis.pid" 2>/dev/null || true)
    # This folder's server still up on another port: stop it (only if that pid is a Redis).
    if [ -n "$old" ] && [ "$(ps -p "$old" -o comm= 2>/dev/null)" = redis-server ]; then
      kill "$old" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$old" 2>/dev/null || break; sleep 0.1; done
    fi
    redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --daemonize yes --save "" \
      --appendonly "$appendonly" --dir "$STATE/redis" --pidfile "$STATE/redis/redis.pid" \
      --logfile "$STATE/redis/redis.log" >&2
    for _ in $(seq 50); do redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
    redis-cli -p "$REDIS_PORT" ping >/dev/null || { tail -20 "$STATE/redis/redis.log" >&2; exit 1; }
  fi
  log "Redis ready on 127.0.0.1:$REDIS_PORT"
  echo "export REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0"
  echo "export TESSERA_REDIS_PID=$(cat "$STATE/redis/redis.pid")"
}

down() {
  local bin
  if bin=$(pg_bin) && [ -s "$STATE/pg/PG_VERSION" ]; then
    if [ "$(id -u)" = 0 ]; then
      runuser -u postgres -- "$bin/pg_ctl" -D "$STATE/pg" -m fast stop >&2 || true
    else
      "$bin/pg_ctl" -D "$STATE/pg" -m fast stop >&2 || true
    fi
  fi
  if command -v redis-cli >/dev/null; then redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true; fi
}

case "${1:-up}" in
  up) pg_up; redis_up ;;
  postgres) pg_up ;;
  redis) redis_up ;;
  down) down ;;
  *) echo "usage: $0 [up|postgres|redis|down]" >&2; exit 2 ;;
esac
