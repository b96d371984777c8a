"""Builders and small clients the end-to-end suite and the benchmark share.

Kubernetes objects are plain dicts (what `kubectl apply` would read); the Tessera REST calls go
through `requests` against the real control plane, exactly as a node plugin or script would.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import requests

from controlplane.scheduling import ResourceNames
from e2e.cluster import KWOK_LABEL, WEBHOOK_SKIP_LABEL, Cluster

A100 = "NVIDIA A100-SXM4-80GB"

# The resource names the builders use unless told otherwise: HAMi's (the control plane's
# defaults), or what the session's control plane was configured with (tests/e2e/conftest.py
# calls `use_resources` with the chart's names in chart mode, before any object is built).
_resources = ResourceNames()
_node_resource = _resources.gpu


def use_resources(names: ResourceNames, node_resource: str | None = None) -> None:
    """Make pods ask for `names` and nodes advertise `node_resource` (default `names.gpu`)."""
    global _resources, _node_resource
    _resources = names
    _node_resource = node_resource or names.gpu


def resources() -> ResourceNames:
    """The names `gpu_pod` asks for (see `use_resources`)."""
    return _resources


POOL_LABEL = "tessera.io/e2e-pool"


def gpu_node(
    name: str,
    *,
    cards: int = 8,
    slots: int = 10,
    model: str = A100,
    pool: str = "shared",
    resource: str | None = None,
) -> dict[str, Any]:
    """A Node for kwok to run: it reports `cards x slots` slice slots like the node plugin.

    `pool` labels it so a test can keep its pods on nodes of its own (`gpu_pod(pool=...)`).
    `resource`: the name it advertises them under (default: see `use_resources`).
    """
    capacity = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "250",
        "ephemeral-storage": "1Ti",
        resource or _node_resource: str(cards * slots),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                KWOK_LABEL: "true",
                POOL_LABEL: pool,
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "tessera.io/e2e-gpu-model": model.replace(" ", "_")[:63],
            },
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {},
        # Nodes take their status on create; kwok keeps it Ready from then on.
        "status": {"capacity": capacity, "allocatable": capacity, "phase": "Running"},
    }


def inventory(
    node: str, *, cards: int = 8, model: str = A100, memory_mib: int = 81920
) -> dict[str, Any]:
    """The node plugin's report for a simulated node (DESIGN §7)."""
    return {
        "plugin_version": "e2e",
        "cards": [
            {
                "uuid": f"GPU-{node}-{i}",
                "index": i,
                "model": model,
                "memory_mib": memory_mib,
                "numa_node": i // 4,
                "healthy": True,
                "health_reason": "",
            }
            for i in range(cards)
        ],
    }


def namespace(
    name: str, *, webhook: bool = True, labels: dict[str, str] | None = None
) -> dict[str, Any]:
    all_labels = dict(labels or {})
    if not webhook:
        all_labels[WEBHOOK_SKIP_LABEL] = "skip"
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": all_labels},
    }


def create_namespace(
    core: Any, name: str, *, webhook: bool = True, labels: dict[str, str] | None = None
) -> str:
    """A namespace with the `default` ServiceAccount (no controller-manager's ServiceAccount
    controller runs in the harness to make it)."""
    core.create_namespace(namespace(name, webhook=webhook, labels=labels))
    core.create_namespaced_service_account(
        name, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}
    )
    return name


def gpu_pod(
    name: str,
    *,
    gpus: int = 1,
    gpumem: int | None = None,
    gpucores: int | None = None,
    scheduler_name: str | None = None,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    pool: str = "shared",
    names: ResourceNames | None = None,
) -> dict[str, Any]:
    """A pod asking for `gpus` slices of `gpumem` MiB and `gpucores` percent each (DESIGN §3),
    under the resource names `names` (default: see `use_resources`)."""
    names = names or _resources
    limits = {names.gpu: str(gpus)}
    if gpumem is not None:
        limits[names.gpumem] = str(gpumem)
    if gpucores is not None:
        limits[names.gpucores] = str(gpucores)
    spec: dict[str, Any] = {
        "containers": [
            {"name": "app", "image": "registry.invalid/cuda-app:1", "resources": {"limits": limits}}
        ],
        # kwok nodes carry no taints; keep pods on the pool's and let them end at once.
        "nodeSelector": {KWOK_LABEL: "true", POOL_LABEL: pool},
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
    }
    if scheduler_name:
        spec["schedulerName"] = scheduler_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}},
        "spec": spec,
    }


def plain_pod(name: str) -> dict[str, Any]:
    """A pod with no GPU: the default scheduler places it, Tessera is not involved."""
    pod = gpu_pod(name)
    pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "100m"}}
    return pod


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll until `predicate()` is truthy; return its value, or fail naming `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def wait_running(core: Any, namespace: str, name: str, timeout: float = 60) -> Any:
    """The pod once it is Running (a kubernetes client V1Pod); on a timeout the failure names
    where it got stuck (its PodScheduled conditions while it has no node)."""
    stuck: list[str] = []

    def running() -> Any:
        pod = core.read_namespaced_pod(name, namespace)
        if pod.status.phase == "Running":
            return pod
        stuck[:] = (
            []
            if pod.spec.node_name
            else [
                f"{c.type}={c.status} {c.reason}: {c.message}" for c in pod.status.conditions or []
            ]
        )
        return None  # a list of conditions must not count as "running"

    try:
        return wait_for(running, timeout=timeout, what=f"pod {namespace}/{name} to run")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; conditions: {stuck}") from None


class Tessera:
    """The control plane's REST API, as seen from outside (tokens, no Django imports)."""

    def __init__(self, base_url: str, token: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.session = requests.Session()
        self.session.trust_env = False  # loopback only: no proxies or CA bundles from the env
        self.session.headers["Authorization"] = f"Bearer {token}"

    def with_token(self, token: str) -> Tessera:
        return Tessera(self.base_url, token)

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return self.session.get(f"{self.base_url}{path}", timeout=30, **kwargs)

    def put(self, path: str, body: Any) -> requests.Response:
        return self.session.put(f"{self.base_url}{path}", json=body, timeout=30)

    def post(self, path: str, body: Any) -> requests.Response:
        return self.session.post(f"{self.base_url}{path}", json=body, timeout=30)

    def report_inventory(self, node: str, report: dict[str, Any]) -> requests.Response:
        return self.put(f"/api/v1/nodes/{node}/inventory", report)

    def why(self, namespace: str, name: str) -> requests.Response:
        return self.get(f"/api/v1/pods/{namespace}/{name}/why")

    def allocation(self, namespace: str, name: str) -> requests.Response:
        return self.get(f"/api/v1/allocations/{namespace}/{name}")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def chunks(items: list[Any], size: int) -> Iterable[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


class Api:
    """Raw JSON against the API server with the harness's admin certificate, per thread."""

    def __init__(self, cluster: Cluster) -> None:
        self.base = cluster.apiserver_url
        self.cert = (str(cluster.pki / "admin.crt"), str(cluster.pki / "admin.key"))
        self.ca = str(cluster.pki / "ca.crt")
        self.local = threading.local()

    def session(self) -> requests.Session:
        session = getattr(self.local, "session", None)
        if session is None:
            session = requests.Session()
            session.trust_env = False  # REQUESTS_CA_BUNDLE would replace the harness's CA
            session.cert, session.verify = self.cert, self.ca
            self.local.session = session
        return session

    def post(self, path: str, body: Any, ok: tuple[int, ...] = (200, 201)) -> Any:
        resp = self.session().post(f"{self.base}{path}", json=body, timeout=60)
        if resp.status_code not in ok:
            raise RuntimeError(f"POST {path}: {resp.status_code} {resp.text[:500]}")
        return resp.json()

    def get(self, path: str) -> Any:
        resp = self.session().get(f"{self.base}{path}", timeout=60)
        resp.raise_for_status()
        return resp.json()

    def delete(self, path: str, ok: tuple[int, ...] = (200, 202, 404)) -> None:
        resp = self.session().delete(f"{self.base}{path}", timeout=60)
        if resp.status_code not in ok:
            raise RuntimeError(f"DELETE {path}: {resp.status_code} {resp.text[:500]}")

    def events(
        self, path: str, stop: threading.Event, timeout: tuple[float, float]
    ) -> Iterator[dict[str, Any]]:
        """The events of a watch (`path` asks `watch=true`), decoded, until it ends or `stop`
        is set. Raises requests' errors, also for an answer that is not 200."""
        with self.session().get(f"{self.base}{path}", stream=True, timeout=timeout) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if stop.is_set():
                    return
                if line:
                    yield json.loads(line)
