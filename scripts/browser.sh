#!/usr/bin/env bash
# Make sure the headless browser the dashboard's browser tests drive is installed: Debian's
# `chromium` at /usr/bin/chromium. Idempotent: does nothing when it is already there. The tests
# drive it with Playwright for Python (its bundled driver), never with `playwright install`,
# which would download a browser build from outside the package registries.
#   scripts/browser.sh        -> installs chromium when absent, prints its path
set -euo pipefail

CHROMIUM=${TESSERA_CHROMIUM:-/usr/bin/chromium}
log() { echo "browser: $*" >&2; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

if [ ! -x "$CHROMIUM" ]; then
  log "installing chromium from Debian's packages"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || true
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium fonts-dejavu-core >&2
fi
[ -x "$CHROMIUM" ] || { log "error: $CHROMIUM is still missing after the install"; exit 1; }
log "$("$CHROMIUM" --version 2>/dev/null || echo chromium) at $CHROMIUM"
echo "$CHROMIUM"
