"""The Binding POST against a real kube-apiserver through each of the control plane's request
paths (controlplane/kube/real.py), side by side.

Run: ``TESSERA_E2E_CACHE=/var/tmp/tessera-e2e-cache .venv/bin/python bench/bench_kube_bind.py
[--rounds 12] [--per-round 100]``

Starts etcd and kube-apiserver only (the harness's pinned binaries, e2e/cluster.py), creates
pods nobody schedules, and binds each once, in rounds that alternate the order of the paths:

- ``lean``: `RealKube.bind_pod` on its `http.client` path (the one production takes);
- ``call_api``: `RealKube.bind_pod` on the official client's `ApiClient.call_api` (the same
  configuration with socket options set, which that path does not cover);
- ``generated``: `CoreV1Api.create_namespaced_binding(_preload_content=False)`.

Prints, per path, the median and p99 of the wall time per bind, the median CPU time of this
process per bind, and the median's ratio to ``generated``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from e2e import cluster as harness  # noqa: E402 - after the path insert
from e2e.objects import create_namespace  # noqa: E402

NAMESPACE = "bench"


def start(run_dir: Path) -> harness.Cluster:
    """etcd and kube-apiserver of a harness run, nothing else."""
    return harness.ApiServerOnly(harness.Options(run_dir=run_dir)).up()


def measure(kubeconfig: Path, rounds: int, per_round: int) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    from kubernetes import client as k8s
    from urllib3.connection import HTTPConnection

    from controlplane.kube.base import API_TIMEOUT_S
    from controlplane.kube.real import RealKube

    lean = RealKube("kubeconfig", str(kubeconfig))
    configuration = k8s.Configuration.get_default_copy()
    configuration.socket_options = list(HTTPConnection.default_socket_options)
    official = RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(configuration)))
    create_namespace(lean.api, NAMESPACE, webhook=False)

    def generated(name: str, uid: str) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
        }
        answer = lean.api.create_namespaced_binding(
            NAMESPACE, body, _preload_content=False, _request_timeout=API_TIMEOUT_S
        )
        json.loads(answer.data)

    paths: dict[str, Callable[[str, str], None]] = {
        "lean": lambda name, uid: lean.bind_pod(NAMESPACE, name, uid, "n1", {}),
        "call_api": lambda name, uid: official.bind_pod(NAMESPACE, name, uid, "n1", {}),
        "generated": generated,
    }
    made = 0

    def pods(n: int) -> list[tuple[str, str]]:
        nonlocal made
        out = []
        for _ in range(n):
            made += 1
            pod = lean.create_pod(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"p{made}", "namespace": NAMESPACE},
                    "spec": {
                        "schedulerName": "nobody",
                        "automountServiceAccountToken": False,
                        "containers": [{"name": "c", "image": "registry.invalid/x:1"}],
                    },
                }
            )
            out.append((pod["metadata"]["name"], pod["metadata"]["uid"]))
        return out

    for bind in paths.values():  # warm each path's connection and code
        for name, uid in pods(20):
            bind(name, uid)
    wall: dict[str, list[float]] = {k: [] for k in paths}
    cpu: dict[str, list[float]] = {k: [] for k in paths}
    for r in range(rounds):
        for key in list(paths) if r % 2 == 0 else list(reversed(paths)):
            for name, uid in pods(per_round):
                t0, c0 = time.perf_counter(), time.process_time()
                paths[key](name, uid)
                wall[key].append(time.perf_counter() - t0)
                cpu[key].append(time.process_time() - c0)
    base = statistics.median(wall["generated"])
    for key in paths:
        ordered = sorted(wall[key])
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        print(
            f"{key:10s} n={len(ordered)} wall median {statistics.median(ordered) * 1e3:.3f} ms "
            f"p99 {p99 * 1e3:.3f} ms, cpu median {statistics.median(cpu[key]) * 1e3:.3f} ms, "
            f"median / generated {statistics.median(ordered) / base:.3f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--per-round", type=int, default=100)
    args = parser.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-kube-bind-"))
    shutil.rmtree(run_dir)
    cluster = start(run_dir)
    try:
        measure(cluster.kubeconfig, args.rounds, args.per_round)
    finally:
        cluster.down(quiet=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
