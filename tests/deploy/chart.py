"""Helpers of the Helm chart tests: the pinned helm binary, rendering, and the harness's
etcd + kube-apiserver without the rest of the e2e cluster.

The helm binary is the one e2e/build.sh builds from the Go module proxy (version pinned in
e2e/versions.env). When it is missing it is built; when that fails the tests fail with the
reason, they never skip.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from e2e.harness import cache_dir, load_versions

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tessera"
HERE = Path(__file__).resolve().parent
VALUES_FILES = sorted(p.name for p in HERE.glob("values-*.yaml"))
# The values files of the extender mode (the chart's default `mode`): the e2e harness's chart
# mode reads the tessera-scheduler and its extender from them; DRA mode has neither.
EXTENDER_VALUES_FILES = [
    name
    for name in VALUES_FILES
    if (yaml.safe_load((HERE / name).read_text()) or {}).get("mode", "extender") == "extender"
]
# `helm template` runs offline; pin the cluster version it pretends to talk to (a helm built with
# `go install` would otherwise assume v1.20, below the chart's kubeVersion).
KUBE_VERSION = "v1.33.2"
RELEASE = "tessera"
NAMESPACE = "tessera-system"


@functools.cache
def helm_path() -> Path:
    """The pinned helm, built by e2e/build.sh when absent; raises with the reason otherwise."""
    version = load_versions().get("HELM_VERSION")
    if not version:
        raise RuntimeError("e2e/versions.env pins no HELM_VERSION: add HELM_VERSION=v3.x.y there")
    binary = cache_dir() / "bin" / f"helm-{version}" / "helm"
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    proc = subprocess.run(
        [str(ROOT / "e2e" / "build.sh"), "helm"],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"helm {version} is not at {binary} and `e2e/build.sh helm` failed "
            f"(exit {proc.returncode}); it builds helm from the Go module proxy and needs Go "
            f"(docs/e2e.md). Its output:\n{proc.stderr[-3000:]}"
        )
    for line in proc.stdout.splitlines():
        name, _, path = line.partition(" ")
        if name == "helm":
            return Path(path)
    raise RuntimeError(f"e2e/build.sh helm printed no helm path:\n{proc.stdout}")


def helm_env(home: Path) -> dict[str, str]:
    """Keep helm's cache, config and data out of $HOME."""
    return {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }


def run_helm(*args: str, home: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(helm_path()), *args],
        capture_output=True,
        text=True,
        check=False,
        env=helm_env(home),
        timeout=300,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


@functools.cache
def _render(values: tuple[str, ...], sets: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    home = Path(os.environ.get("TMPDIR", "/tmp")) / f"tessera-helm-{os.getpid()}"
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--kube-version",
            KUBE_VERSION]  # fmt: skip
    for name in values:
        args += ["--values", str(HERE / name)]
    for item in sets:
        args += ["--set", item]
    proc = run_helm(*args, home=home)
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def render(*values: str, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """`helm template` of the chart with these values files (names in tests/deploy/): a deep
    copy of the cached rendering, so a test may change it freely."""
    return copy.deepcopy(list(_render(tuple(values), sets)))


def container(docs: list[dict[str, Any]], component: str, name: str) -> dict[str, Any]:
    """Container `name` of the rendered Deployment whose component label is `component` (the
    same dict as in `docs`: changing it changes `docs`)."""
    for doc in docs:
        labels = doc["metadata"].get("labels") or {}
        if doc["kind"] == "Deployment" and labels.get("app.kubernetes.io/component") == component:
            for item in doc["spec"]["template"]["spec"]["containers"]:
                if item["name"] == name:
                    return item  # type: ignore[no-any-return]
    raise AssertionError(f"the rendered chart has no {component} container {name}")
