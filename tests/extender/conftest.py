"""Shared pieces of the extender tests: a fake Kubernetes adapter and JSON posting helpers.

The adapter is faked at its getter (`controlplane.kube.adapter.get_kube`), never at HTTP: the
fake keeps pods in memory and applies the API server's bind rules (UID precondition, one
assignment).
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from controlplane.extender.snapshots import snapshot_cache
from controlplane.extender.verbs import recent_requests
from controlplane.kube import adapter
from controlplane.kube import base as kube

FIXTURES = Path(__file__).parent / "fixtures"


def fixture_pod() -> dict[str, Any]:
    """A full v1.Pod as the API server serves it (managedFields, init + several containers)."""
    return json.loads((FIXTURES / "pod_v1_trainer.json").read_text())


class FakeKube:
    """In-memory API server for pods. `fail_bind` / `fail_get` inject errors."""

    mode = "fake"

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.bind_calls: list[tuple[str, str, str, str, dict[str, str]]] = []
        self.get_calls = 0
        self.fail_bind: Callable[[], None] | None = None
        self.fail_get: Callable[[], None] | None = None
        self.events: list[dict[str, Any]] = []
        self.evictions: list[tuple[str, str]] = []
        self.refuse_eviction: Callable[[str, str], bool] | None = None
        self.keep_evicted = False  # True: an evicted pod lingers (its grace period)
        self.budgets: list[dict[str, Any]] = []
        # resource.k8s.io/v1 objects, as the API server serves them
        self.claims: list[dict[str, Any]] = []
        self.claim_templates: dict[tuple[str, str], dict[str, Any]] = {}
        self.resource_slices: list[dict[str, Any]] = []
        self.fail_claims: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def add(self, pod: dict[str, Any]) -> dict[str, Any]:
        meta = pod["metadata"]
        self.pods[(meta.get("namespace", "default"), meta["name"])] = copy.deepcopy(pod)
        return pod

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.get_calls += 1
        if self.fail_get is not None:
            self.fail_get()
        pod = self.pods.get((namespace, name))
        return copy.deepcopy(pod) if pod is not None else None

    def list_pods(self, namespace: str | None = None, *, node_name: str | None = None):
        return [
            copy.deepcopy(p)
            for (ns, _), p in self.pods.items()
            if namespace in (None, ns)
            and (node_name is None or p.get("spec", {}).get("nodeName") == node_name)
        ]

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        return self.add(pod)

    def delete_pod(self, namespace: str, name: str) -> bool:
        return self.pods.pop((namespace, name), None) is not None

    def bind_pod(self, namespace, name, uid, node, annotations) -> None:
        with self._lock:
            self.bind_calls.append((namespace, name, uid, node, dict(annotations)))
            if self.fail_bind is not None:
                self.fail_bind()
            pod = self.pods.get((namespace, name))
            if pod is None:
                raise kube.KubeError(f'pods "{name}" not found', 404, False)
            if pod["metadata"].get("uid") != uid:
                raise kube.KubeError("Precondition failed: UID", 409, False)
            if pod.get("spec", {}).get("nodeName"):
                raise kube.KubeError(f"pod {name} is already assigned", 409, False)
            pod["spec"]["nodeName"] = node
            ann = pod["metadata"].setdefault("annotations", {})
            ann.update(annotations)

    def watch_pods(self, cursor, timeout_s):
        return iter(())

    def create_event(self, namespace, event) -> None:
        self.events.append(copy.deepcopy(event))

    def evict_pod(self, namespace, name, uid) -> bool:
        self.evictions.append((namespace, name))
        if self.refuse_eviction is not None and self.refuse_eviction(namespace, name):
            raise kube.KubeError("Cannot evict pod as it would violate the pod's disruption "
                                 "budget.", 429, False)  # fmt: skip
        pod = self.pods.get((namespace, name))
        if pod is None or pod["metadata"].get("uid") != uid:
            return False
        if not self.keep_evicted:
            del self.pods[(namespace, name)]
        return True

    def nominate_pod(self, namespace, name, node, annotations) -> None:
        pod = self.pods.get((namespace, name))
        if pod is None:
            raise kube.KubeError(f'pods "{name}" not found', 404, False)
        pod.setdefault("status", {})["nominatedNodeName"] = node
        pod["metadata"].setdefault("annotations", {}).update(annotations)

    def list_disruption_budgets(self, namespace) -> list[dict[str, Any]]:
        return [copy.deepcopy(b) for b in self.budgets if b["metadata"]["namespace"] == namespace]

    def list_resource_claims(self, namespace=None) -> list[dict[str, Any]]:
        if self.fail_claims is not None:
            self.fail_claims()
        return [
            copy.deepcopy(c)
            for c in self.claims
            if namespace in (None, c["metadata"].get("namespace"))
        ]

    def get_claim_template(self, namespace, name) -> dict[str, Any] | None:
        found = self.claim_templates.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def list_resource_slices(self, driver) -> list[dict[str, Any]]:
        return [copy.deepcopy(s) for s in self.resource_slices if s["spec"]["driver"] == driver]


@pytest.fixture
def fake_kube(monkeypatch: pytest.MonkeyPatch) -> FakeKube:
    fake = FakeKube()
    monkeypatch.setattr(adapter, "get_kube", lambda: fake)
    return fake


@pytest.fixture(autouse=True)
def _fresh_snapshot_cache() -> None:
    # The caches are per process; a test's rows are rolled back after it, so start clean.
    snapshot_cache.clear()
    recent_requests.clear()


def post(client: Client, path: str, body: Any, **extra: Any):
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    return client.post(path, data=data, content_type="application/json", **extra)
