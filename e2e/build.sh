#!/usr/bin/env bash
# Build the pinned Kubernetes binaries the end-to-end harness runs, from the Go module proxy:
#   kube-apiserver, kube-scheduler, kubectl (k8s.io/kubernetes, pinned by e2e/tools/go.mod),
#   kwok (sigs.k8s.io/kwok) and helm (helm.sh/helm/v3), all versions from e2e/versions.env;
#   for the real node: kubelet and kube-controller-manager (k8s.io/kubernetes), containerd,
#   containerd-shim-runc-v2 and ctr (github.com/containerd/containerd/v2), crictl
#   (sigs.k8s.io/cri-tools) and the OCI registry (github.com/distribution/distribution/v3);
#   for the Kueue test: kueue (sigs.k8s.io/kueue), with its CRDs and webhook manifests;
#   for the benchmark against HAMi, only when named: hami-scheduler, from HAMi's source tarball
#   (HAMI_VERSION in e2e/versions.env; see hami_tarball below), with HAMi's chart beside it.
# Output: $TESSERA_E2E_CACHE/bin/<name>-<version>/<name> (default cache: .cache/e2e). A binary
# that is already there is kept, so a warm run costs nothing. --force rebuilds.
#   e2e/build.sh [--force] [NAME...]   NAMEs: see ALL below (default: all)
# Go's module and build caches live under the same cache folder, not in $HOME. Several build.sh
# may run at once (the suite's background build and a test asking for a binary): each binary is
# built under a lock of its own, and one that waited finds the binary built.
# Prints one line per binary: "<name> <path>".
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=versions.env
. "$ROOT/e2e/versions.env"
CACHE=${TESSERA_E2E_CACHE:-$ROOT/.cache/e2e}
FORCE=0
if [ "${1:-}" = "--force" ]; then FORCE=1; shift; fi
WANT=("$@")
ALL=(kube-apiserver kube-scheduler kubectl kwok helm kubelet kube-controller-manager containerd
     containerd-shim-runc-v2 ctr crictl registry kueue)
# Built only when asked for by name: it needs a source tree the machine may not have.
ON_REQUEST=(hami-scheduler)
[ ${#WANT[@]} -gt 0 ] || WANT=("${ALL[@]}")
for name in "${WANT[@]}"; do
  case " ${ALL[*]} ${ON_REQUEST[*]} " in *" $name "*) ;; *) echo "e2e-build: error: unknown binary $name (known: ${ALL[*]} ${ON_REQUEST[*]})" >&2; exit 2 ;; esac
done
wanted() { local n; for n in "${WANT[@]}"; do [ "$n" = "$1" ] && return 0; done; return 1; }

log() { echo "e2e-build: $*" >&2; }
die() { echo "e2e-build: error: $*" >&2; exit 1; }

mkdir -p "$CACHE"

minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
ldflags="-s -w \
 -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION \
 -X k8s.io/component-base/version.gitMajor=1 \
 -X k8s.io/component-base/version.gitMinor=$minor \
 -X k8s.io/component-base/version.gitTreeState=clean \
 -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION"

# Everything a build needs, done once and only when something is missing (a warm run needs no
# Go at all).
PREPARED=0
prepare() {
  [ "$PREPARED" = 1 ] && return 0
  PREPARED=1
  # Go: the machine's when it is at least GO_TOOLCHAIN, else GO_TOOLCHAIN's distribution as the Go
  # module proxy serves it (golang.org/toolchain, the zip the go command itself would fetch),
  # unpacked once into the cache. So a bare CI machine needs no Go package at all.
  go_new_enough() {
    command -v go >/dev/null || return 1
    local have; have=$(GOTOOLCHAIN=local go env GOVERSION 2>/dev/null) || return 1
    [ "$(printf '%s\n%s\n' "$have" "$GO_TOOLCHAIN" | sort -V | head -1)" = "$GO_TOOLCHAIN" ]
  }
  if ! go_new_enough; then
    goroot=$CACHE/toolchain/$GO_TOOLCHAIN
    take_lock toolchain
    if [ ! -x "$goroot/bin/go" ]; then
      arch=$(uname -m); case $arch in x86_64) arch=amd64 ;; aarch64) arch=arm64 ;; esac
      proxy=${GOPROXY:-https://proxy.golang.org}; proxy=${proxy%%,*}
      url="$proxy/golang.org/toolchain/@v/v0.0.1-$GO_TOOLCHAIN.linux-$arch.zip"
      log "no Go >= $GO_TOOLCHAIN here: fetching $url"
      tmp=$(mktemp -d "$CACHE/toolchain.XXXXXX")
      curl -fsSL --retry 3 -o "$tmp/go.zip" "$url" || { rm -rf "$tmp"; die "cannot download $url"; }
      (cd "$tmp" && unzip -q go.zip) || { rm -rf "$tmp"; die "cannot unpack $url (is unzip installed?)"; }
      mkdir -p "$(dirname "$goroot")"
      mv "$tmp/golang.org/toolchain@v0.0.1-$GO_TOOLCHAIN.linux-$arch" "$goroot"; rm -rf "$tmp"
    fi
    drop_lock toolchain
    export PATH=$goroot/bin:$PATH GOROOT=$goroot
  fi
  export GOMODCACHE=$CACHE/gomod GOCACHE=$CACHE/gocache GOTOOLCHAIN=local

  # Static binaries, no host paths inside, and at most E2E_GO_PARALLEL packages compiled at once
  # (the build is a big one; leave the machine usable for the rest of CI).
  export CGO_ENABLED=0 GOFLAGS="-p=${E2E_GO_PARALLEL:-2} -trimpath -mod=readonly"

  TOOLS=$ROOT/e2e/tools
  grep -Eq "^(require |	)k8s\.io/kubernetes $KUBERNETES_VERSION( |\$)" "$TOOLS/go.mod" \
    || die "e2e/tools/go.mod does not require k8s.io/kubernetes $KUBERNETES_VERSION (e2e/versions.env): update both together"
  if grep -E '^	k8s\.io/[a-z-]+ => k8s\.io/[a-z-]+ v' "$TOOLS/go.mod" | grep -v " $KUBERNETES_STAGING_VERSION\$" >&2; then
    die "the replace lines above in e2e/tools/go.mod are not at $KUBERNETES_STAGING_VERSION (e2e/versions.env)"
  fi
}

# take_lock NAME / drop_lock NAME: one holder of $CACHE/locks/NAME at a time (flock; released
# by the kernel if this script dies).
declare -A LOCKS=()
take_lock() {
  local fd
  mkdir -p "$CACHE/locks"
  exec {fd}>"$CACHE/locks/$1"
  if ! flock -n "$fd"; then
    log "waiting for another e2e/build.sh to finish $1"
    flock "$fd"
  fi
  LOCKS[$1]=$fd
}
drop_lock() { exec {LOCKS[$1]}>&-; unset "LOCKS[$1]"; }

# build_one NAME VERSION COMMAND...: run COMMAND with $OUT set to a fresh folder, then move
# $OUT/NAME into place (so a half-built binary is never mistaken for a finished one).
build_one() {
  local name=$1 version=$2; shift 2
  local dir=$CACHE/bin/$name-$version
  if [ "$FORCE" = 0 ] && [ -x "$dir/$name" ]; then
    echo "$name $dir/$name"; return 0
  fi
  take_lock "$name-$version"
  if [ "$FORCE" = 0 ] && [ -x "$dir/$name" ]; then  # built by the build we waited for
    drop_lock "$name-$version"; echo "$name $dir/$name"; return 0
  fi
  prepare
  local out; out=$(mktemp -d "$CACHE/build.XXXXXX")
  local start=$SECONDS
  log "building $name $version (cold builds take minutes; see docs/e2e.md)"
  OUT=$out "$@" || { rm -rf "$out"; die "building $name $version failed (output above)"; }
  [ -x "$out/$name" ] || { rm -rf "$out"; die "building $name $version produced no binary"; }
  mkdir -p "$dir"; mv -f "$out/$name" "$dir/$name"; rm -rf "$out"
  drop_lock "$name-$version"
  log "built $name $version in $((SECONDS - start)) s"
  echo "$name $dir/$name"
}

k8s_build() { (cd "$TOOLS" && nice go build -ldflags "$ldflags" -o "$OUT/$1" "k8s.io/kubernetes/cmd/$1"); }
go_install() { GOBIN=$OUT GOFLAGS="${GOFLAGS/-mod=readonly/}" nice go install -ldflags "-s -w" "$@"; }
# containerd without the snapshotters that need cgo or kernel features the node does not use
# (overlayfs is the one it runs with), stamped with its version as its release builds are.
containerd_install() {
  go_install -tags no_btrfs,no_devmapper,no_zfs \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
    "github.com/containerd/containerd/v2/cmd/$1@$CONTAINERD_VERSION"
}

# Kueue, stamped with its version, and beside it the manifests e2e/kueue.py applies (its CRDs and
# webhook configurations) from the module just downloaded: copied before the binary is moved into
# place, so a folder with the binary has them too, and a cache of bin/ alone is enough to run it.
kueue_install() {
  go_install -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
    "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION"
  local src=$GOMODCACHE/sigs.k8s.io/kueue@$KUEUE_VERSION/config/components
  local dir=$CACHE/bin/kueue-$KUEUE_VERSION
  mkdir -p "$dir"; rm -rf "$dir/crd" "$dir/webhook"
  cp -r "$src/crd/bases" "$dir/crd"; mkdir "$dir/webhook"; cp "$src/webhook/manifests.yaml" "$dir/webhook/"
  chmod -R u+w "$dir/crd" "$dir/webhook"  # the module cache is read-only; these need not be
}

if wanted kube-apiserver; then build_one kube-apiserver "$KUBERNETES_VERSION" k8s_build kube-apiserver; fi
if wanted kube-scheduler; then build_one kube-scheduler "$KUBERNETES_VERSION" k8s_build kube-scheduler; fi
# kubectl runs the `kubectl tessera` plugin in tests/kubectl. A go build of its own, like the
# others: the packages it shares with them (client-go, apimachinery, ...) come compiled from
# GOCACHE, so only kubectl's own (k8s.io/kubectl, cli-runtime, kustomize) cost time cold.
if wanted kubectl; then build_one kubectl "$KUBERNETES_VERSION" k8s_build kubectl; fi
if wanted kwok; then build_one kwok "$KWOK_VERSION" go_install "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"; fi
if wanted helm; then build_one helm "$HELM_VERSION" go_install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"; fi
if wanted kubelet; then build_one kubelet "$KUBERNETES_VERSION" k8s_build kubelet; fi
if wanted kube-controller-manager; then
  build_one kube-controller-manager "$KUBERNETES_VERSION" k8s_build kube-controller-manager
fi
for name in containerd containerd-shim-runc-v2 ctr; do
  if wanted $name; then build_one $name "$CONTAINERD_VERSION" containerd_install $name; fi
done
if wanted crictl; then build_one crictl "$CRICTL_VERSION" go_install "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"; fi
if wanted registry; then
  build_one registry "$REGISTRY_VERSION" go_install "github.com/distribution/distribution/v3/cmd/registry@$REGISTRY_VERSION"
fi
if wanted kueue; then build_one kueue "$KUEUE_VERSION" kueue_install; fi

# HAMi's scheduler extender, from HAMI_VERSION's source tarball (e2e/versions.env says why not
# from the Go module proxy; its dependencies do come from it). The tarball is read where it lies,
# never copied into the project: TESSERA_HAMI_SRC_TARBALL, else shared/peers/hami/ next to this
# checkout or above it, or next to the checkout this clone was made from. The .sha256 beside it
# holds the hash alone: the build goes into a folder keyed on it, so a different tarball is never
# mistaken for a built one, and the tarball is checked against it before it is unpacked.
hami_tarball() {
  local given=${TESSERA_HAMI_SRC_TARBALL:-}
  if [ -n "$given" ]; then
    [ -f "$given" ] || die "hami-scheduler: TESSERA_HAMI_SRC_TARBALL=$given is not a file"
    echo "$given"; return 0
  fi
  local file=hami-$HAMI_VERSION-src.tar.gz start dir origin
  origin=$(git -C "$ROOT" remote get-url origin 2>/dev/null || true); origin=${origin#file://}
  for start in "$ROOT" ${origin:+"$origin"}; do
    [ -d "$start" ] || continue
    dir=$(cd "$start" && pwd -P)
    while [ "$dir" != / ]; do
      dir=$(dirname "$dir")
      [ -f "$dir/shared/peers/hami/$file" ] && { echo "$dir/shared/peers/hami/$file"; return 0; }
    done
  done
  die "hami-scheduler: no $file in shared/peers/hami/ next to $ROOT or above it; set TESSERA_HAMI_SRC_TARBALL to it"
}
# HAMi's scheduler links NVIDIA's go-nvml, whose types exist only in cgo builds (it never calls NVML
# on this path), so cgo is on for this one. Its chart is copied beside the binary: e2e/hami.py
# configures the scheduler from the chart's rendered manifests, so a cache of bin/ alone is
# enough to run it.
hami_install() {
  local want; want=$(tr -d ' \n' <"$HAMI_TARBALL.sha256")
  local have; have=$(sha256sum "$HAMI_TARBALL" | cut -d' ' -f1)
  [ "$have" = "$want" ] || die "hami-scheduler: $HAMI_TARBALL has sha256 $have, $HAMI_TARBALL.sha256 says $want"
  tar -xzf "$HAMI_TARBALL" -C "$OUT"
  local src=$OUT/hami-$HAMI_VERSION
  [ -f "$src/go.mod" ] && [ -d "$src/cmd/scheduler" ] && [ -f "$src/charts/hami/Chart.yaml" ] \
    || die "hami-scheduler: $HAMI_TARBALL holds no hami-$HAMI_VERSION/ with go.mod, cmd/scheduler and charts/hami"
  (cd "$src" && CGO_ENABLED=1 nice go build \
    -ldflags "-s -w -X github.com/Project-HAMi/HAMi/pkg/version.version=$HAMI_VERSION" \
    -o "$OUT/hami-scheduler" ./cmd/scheduler)
  mkdir -p "$HAMI_DIR"; rm -rf "$HAMI_DIR/chart"; cp -r "$src/charts/hami" "$HAMI_DIR/chart"
}
if wanted hami-scheduler; then
  HAMI_TARBALL=$(hami_tarball)
  [ -f "$HAMI_TARBALL.sha256" ] || die "hami-scheduler: no $HAMI_TARBALL.sha256 beside the tarball"
  HAMI_KEY=$HAMI_VERSION-$(tr -d ' \n' <"$HAMI_TARBALL.sha256" | cut -c1-16)
  HAMI_DIR=$CACHE/bin/hami-scheduler-$HAMI_KEY
  build_one hami-scheduler "$HAMI_KEY" hami_install
fi
