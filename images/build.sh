#!/usr/bin/env bash
# Build Tessera's OCI images without a container engine: a Debian root filesystem from
# mmdebstrap, the project's pinned wheels installed by buildah (`FROM scratch`, chroot
# isolation, no daemon), written as OCI archives.
#
#   images/build.sh [NAME...]        NAMEs: controlplane nodeplugin gpu-test pause (default: all)
#   images/build.sh --push REGISTRY [NAME...]  push the built archives to REGISTRY (skopeo)
#   images/build.sh --run NAME [-e K=V]... -- CMD...  run CMD in a container of the built archive
#                                    (buildah, chroot isolation, the host's network; the checks)
#
# Output: .cache/images/<name>.oci.tar (ignored), each holding one image named
# tessera/<name>:<version>. Everything expensive is cached outside the clone under
# $TESSERA_IMAGE_CACHE (default $TESSERA_E2E_CACHE/images, else .cache/images-cache), keyed by
# its inputs: the base root filesystem by images/base.env, the wheels by images/requirements.lock,
# each image by its Containerfile, the base, the lock and the files it takes from the tree. A
# warm run builds nothing. Prints one line per image: "<name> <archive> <image name>".
#
# Debian's mmdebstrap, buildah and skopeo are installed when absent (apt-get, as root).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
HERE=$ROOT/images
OUT=$ROOT/.cache/images
CACHE=${TESSERA_IMAGE_CACHE:-${TESSERA_E2E_CACHE:+$TESSERA_E2E_CACHE/images}}
CACHE=${CACHE:-$ROOT/.cache/images-cache}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -1)
ALL=(controlplane nodeplugin gpu-test pause)

log() { echo "images: $*" >&2; }
die() { echo "images: error: $*" >&2; exit 1; }

# buildah's own storage, private to this cache: vfs (no overlay mounts to clean up).
BUILDAH=(buildah --root "$CACHE/storage" --runroot "$CACHE/runroot" --storage-driver vfs)

if [ "${1:-}" = "--run" ]; then
  name=${2:-}; shift 2 || die "--run needs an image name"
  envs=()
  while [ "${1:-}" = "-e" ]; do envs+=(--env "$2"); shift 2; done
  [ "${1:-}" = "--" ] && shift
  [ -f "$OUT/$name.oci.tar" ] || die "$OUT/$name.oci.tar is missing: run make images first"
  ctr=$("${BUILDAH[@]}" from --quiet "oci-archive:$OUT/$name.oci.tar") \
    || die "buildah from oci-archive:$OUT/$name.oci.tar failed"
  trap '"${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1' EXIT
  trap 'exit 143' TERM INT
  rc=0
  "${BUILDAH[@]}" run --isolation chroot "${envs[@]}" "$ctr" -- "$@" || rc=$?
  exit $rc
fi

PUSH=""
if [ "${1:-}" = "--push" ]; then
  PUSH=${2:-}; [ -n "$PUSH" ] || die "--push needs a registry, e.g. --push registry.example.com:5000"
  shift 2
fi
WANT=("$@")
[ ${#WANT[@]} -gt 0 ] || WANT=("${ALL[@]}")
for name in "${WANT[@]}"; do
  case " ${ALL[*]} " in *" $name "*) ;; *) die "unknown image $name (known: ${ALL[*]})" ;; esac
done

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
need_tools() {
  local missing=() tool
  for tool in "$@"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]} from Debian's packages"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || true
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2 \
    || die "cannot install ${missing[*]} (apt-get install ${missing[*]})"
}

archive_name() { echo "tessera/$1:$VERSION"; }

if [ -n "$PUSH" ]; then
  need_tools skopeo
  tls=()
  # A registry on this machine's loopback (the e2e harness's) speaks plain HTTP.
  case $PUSH in 127.0.0.1:*|localhost:*) tls=(--dest-tls-verify=false) ;; esac
  for name in "${WANT[@]}"; do
    src=$OUT/$name.oci.tar
    [ -f "$src" ] || die "$src is missing: run make images first"
    ref=$(archive_name "$name")
    skopeo copy --quiet "${tls[@]}" --dest-compress "oci-archive:$src:$ref" "docker://$PUSH/$ref" \
      || die "pushing $name to $PUSH failed (skopeo output above)"
    log "pushed $PUSH/$ref"
    echo "$name $PUSH/$ref"
  done
  exit 0
fi

need_tools mmdebstrap buildah skopeo gcc make
# The pause image's program is linked statically: glibc's static library.
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || need_tools libc6-dev
mkdir -p "$CACHE" "$OUT"
# Two checkouts building at once take turns.
exec 9>"$CACHE/.lock"
flock 9

sha() { sha256sum | cut -c1-16; }
# The tree's files an image takes, as tracked by git (plus new files not ignored), so a fresh
# clone and a working tree with the same content get the same key.
tree_files() { (cd "$ROOT" && git ls-files -co --exclude-standard -- "$@" | LC_ALL=C sort); }
tree_key() { (cd "$ROOT" && tree_files "$@" | while read -r f; do [ -f "$f" ] && { echo "$f"; cat "$f"; }; done) | sha; }
REVISION=$(cd "$ROOT" && git rev-parse HEAD 2>/dev/null || echo unknown)
if [ -n "$(cd "$ROOT" && git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  REVISION="$REVISION-dirty"
fi
# Timestamps inside the images: the commit's, so the same tree builds the same layers.
EPOCH=$(cd "$ROOT" && git log -1 --format=%ct 2>/dev/null || echo 0)

# --- the Debian base ----------------------------------------------------------------------
# shellcheck source=base.env
. "$HERE/base.env"
BASE_KEY=$(sha < "$HERE/base.env")
BASE=$CACHE/base-$BASE_KEY.tar
if [ ! -s "$BASE" ]; then
  mirror=$DEBIAN_MIRROR
  [ -z "$DEBIAN_SNAPSHOT" ] || mirror="http://snapshot.debian.org/archive/debian/$DEBIAN_SNAPSHOT"
  log "building the Debian $DEBIAN_SUITE root filesystem ($DEBIAN_PACKAGES) from $mirror"
  start=$SECONDS
  tmp=$(mktemp "$CACHE/base.XXXXXX.tar")
  SOURCE_DATE_EPOCH=$EPOCH nice mmdebstrap --quiet --mode=root --variant=essential \
    --include="$DEBIAN_PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook='chroot "$1" dpkg-query -W -f "\${Package} \${Version}\n" > "$1/packages.txt"' \
    --customize-hook='mkdir -p "$1/usr/share/tessera" && mv "$1/packages.txt" "$1/usr/share/tessera/packages.txt"' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/* "$1"/var/log/*' \
    "$DEBIAN_SUITE" "$tmp" "$mirror" >&2 || { rm -f "$tmp"; die "mmdebstrap failed (output above)"; }
  tar -xOf "$tmp" ./usr/share/tessera/packages.txt > "$CACHE/base-$BASE_KEY.packages"
  mv -f "$tmp" "$BASE"
  log "built the base in $((SECONDS - start)) s ($(du -m "$BASE" | cut -f1) MB)"
fi

# --- wheels ---------------------------------------------------------------------------------
LOCK=$HERE/requirements.lock
WHEELS=$CACHE/wheels-$(sha < "$LOCK")
if [ ! -f "$WHEELS/.complete" ]; then
  log "downloading the pinned wheels of images/requirements.lock (hashes checked)"
  rm -rf "$WHEELS.tmp"; mkdir -p "$WHEELS.tmp"
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --require-hashes \
    --python-version 3.11 --implementation cp --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -r "$LOCK" -d "$WHEELS.tmp" >&2 || die "pip download of the pinned wheels failed (output above)"
  touch "$WHEELS.tmp/.complete"; rm -rf "$WHEELS"; mv "$WHEELS.tmp" "$WHEELS"
fi

# --- what the images take from the tree -----------------------------------------------------
APP_PATHS=(manage.py pyproject.toml controlplane nodeplugin templates static)

# stage NAME: a build context with the Containerfile's inputs (rootfs and wheels hard-linked
# from the cache, the tree's files copied), in a folder of the cache.
stage() {
  local name=$1 ctx=$CACHE/context-$1
  rm -rf "$ctx"; mkdir -p "$ctx"
  ln "$BASE" "$ctx/rootfs.tar" 2>/dev/null || cp "$BASE" "$ctx/rootfs.tar"
  case $name in
    controlplane|nodeplugin)
      cp -al "$WHEELS" "$ctx/wheels" 2>/dev/null || cp -a "$WHEELS" "$ctx/wheels"
      cp "$LOCK" "$ctx/wheels/requirements.lock"
      mkdir -p "$ctx/app"
      (cd "$ROOT" && tree_files "${APP_PATHS[@]}" | tar -cf - --no-recursion --files-from=-) \
        | tar -xf - -C "$ctx/app"
      ;;
  esac
  case $name in
    nodeplugin)
      make -s -C "$ROOT/shim" PYTHON="$PYTHON" >&2 || die "building the shim (make -C shim) failed"
      cp "$ROOT/shim/build/libtessera.so" "$ctx/libtessera.so"
      ;;
    gpu-test)
      make -s -C "$ROOT/shim" PYTHON="$PYTHON" build/fake/libcuda.so.1 >&2 \
        || die "building the fake libcuda.so.1 (make -C shim build/fake/libcuda.so.1) failed"
      cp "$ROOT/shim/build/fake/libcuda.so.1" "$ctx/libcuda.so.1"
      gcc -O2 -Wall -Wextra -Werror -I"$ROOT/shim/.deps/include" -o "$ctx/gpu-probe" \
        "$HERE/gpu-test/gpu-probe.c" -ldl \
        || die "compiling images/gpu-test/gpu-probe.c failed"
      ;;
    pause)
      gcc -O2 -Wall -Wextra -Werror -static -o "$ctx/pause" "$HERE/pause/pause.c" \
        || die "compiling images/pause/pause.c (static; needs libc6-dev) failed"
      strip "$ctx/pause"
      ;;
  esac
  echo "$ctx"
}

image_key() {
  local name=$1 key
  case $name in
    controlplane|nodeplugin) key=$( { cat "$HERE/Containerfile.$name"; echo "$BASE_KEY"; cat "$LOCK"; tree_key "${APP_PATHS[@]}" shim; } | sha) ;;
    gpu-test) key=$( { cat "$HERE/Containerfile.$name"; echo "$BASE_KEY"; tree_key images/gpu-test shim; } | sha) ;;
    pause) key=$( { cat "$HERE/Containerfile.$name"; tree_key images/pause; } | sha) ;;
  esac
  echo "$key"
}

for name in "${WANT[@]}"; do
  key=$(image_key "$name")
  cached=$CACHE/$name-$key.oci.tar
  ref=$(archive_name "$name")
  if [ ! -s "$cached" ]; then
    log "building $ref"
    start=$SECONDS
    ctx=$(stage "$name")
    "${BUILDAH[@]}" rmi --force "$ref" >/dev/null 2>&1 || true
    tmp=$(mktemp "$CACHE/$name.XXXXXX.tar"); rm -f "$tmp"
    nice "${BUILDAH[@]}" bud --quiet --isolation chroot --layers=false --timestamp "$EPOCH" \
      --build-arg "VERSION=$VERSION" --build-arg "REVISION=$REVISION" \
      --label "org.opencontainers.image.version=$VERSION" \
      --label "org.opencontainers.image.revision=$REVISION" \
      --label "org.opencontainers.image.source=https://github.com/tessera/tessera" \
      --label "org.opencontainers.image.title=tessera-$name" \
      --label "io.tessera.base=debian-$DEBIAN_SUITE-$BASE_KEY" \
      -f "$HERE/Containerfile.$name" -t "$ref" "$ctx" >&2 \
      || die "buildah bud of images/Containerfile.$name failed (output above)"
    "${BUILDAH[@]}" push --quiet "$ref" "oci-archive:$tmp:$ref" >&2 \
      || die "writing $name as an OCI archive failed"
    "${BUILDAH[@]}" rmi --force "$ref" >/dev/null 2>&1 || true
    rm -rf "$ctx"
    mv -f "$tmp" "$cached"
    log "built $ref in $((SECONDS - start)) s ($(du -m "$cached" | cut -f1) MB, layers compressed)"
  fi
  # Keep the three newest builds of each image (other checkouts sharing the cache may use them).
  ls -1t "$CACHE/$name"-*.oci.tar 2>/dev/null | tail -n +4 | while read -r old; do rm -f "$old"; done
  ln -f "$cached" "$OUT/$name.oci.tar" 2>/dev/null || cp -f "$cached" "$OUT/$name.oci.tar"
  echo "$name $OUT/$name.oci.tar $ref"
done
