"""What the control plane asks of the Kubernetes API server, whoever answers it.

Two implementations, one interface (:class:`Kube`): a real API server (`controlplane.kube.real`)
and the embedded stand-in of DESIGN §7 (`controlplane.kube.embedded`), picked by
`controlplane.kube.adapter.get_kube`; tests replace that getter with a fake, not HTTP.

Every call adds its wall time to a per-thread counter (:func:`api_ms`), so the extender can
report the API server's share of a bind apart from Tessera's own (header
`X-Tessera-Apiserver-Ms`, docs/extender.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

API_TIMEOUT_S = 5.0  # kube-scheduler gives the whole bind 5 s by default; stay inside it
API_POOL_SIZE = 32  # connections kept to the API server (request threads + the reconciler)


class KubeError(Exception):
    """An API server call failed.

    `status` is the HTTP status when there was an answer. `applied` says what we know about
    the write: False = certainly not applied (a 4xx refusal, or the request never left), None =
    unknown (timeout, 5xx, broken connection: the server may have done it).
    """

    def __init__(self, message: str, status: int | None = None, applied: bool | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.applied = applied

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change of a pod: ADDED, MODIFIED or DELETED, with the pod as it was then."""

    type: str
    pod: dict[str, Any]
    cursor: str


class Kube(Protocol):
    """What the control plane asks of the API server."""

    mode: str

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod's JSON, or None when it does not exist."""

    def list_pods(
        self, namespace: str | None = None, *, node_name: str | None = None
    ) -> list[dict[str, Any]]:
        """Pods (of a namespace, or all), optionally only those on `node_name`."""

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Create a pod; returns it as stored (uid, creationTimestamp...)."""

    def delete_pod(self, namespace: str, name: str) -> bool:
        """Delete a pod; False when it was already gone."""

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]
    ) -> None:
        """POST the Binding subresource: sets spec.nodeName and merges `annotations` into the
        pod, with `uid` as precondition. Raises KubeError."""

    def watch_pods(self, cursor: str | None, timeout_s: float) -> Iterator[WatchEvent]:
        """Changes after `cursor` (None: from now), for up to `timeout_s` seconds."""

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        """Create a core/v1 Event (`controlplane.kube.events`). Raises KubeError."""

    def evict_pod(self, namespace: str, name: str, uid: str) -> bool:
        """Evict through the Eviction API (PodDisruptionBudgets and the grace period honoured),
        `uid` as precondition; False when the pod was already gone. Raises KubeError (status 429
        when a budget forbids it now)."""

    def nominate_pod(
        self, namespace: str, name: str, node: str, annotations: dict[str, str]
    ) -> None:
        """Set `status.nominatedNodeName` (empty: clear it) and merge `annotations` into the
        pod's (a change to the pod also makes kube-scheduler try it again). Raises KubeError."""

    def list_disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's policy/v1 PodDisruptionBudgets. Raises KubeError."""

    def list_resource_claims(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """resource.k8s.io/v1 ResourceClaims (of a namespace, or all). Raises KubeError."""

    def list_resource_slices(self, driver: str) -> list[dict[str, Any]]:
        """The ResourceSlices `driver` publishes. Raises KubeError."""

    def get_claim_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A resource.k8s.io/v1 ResourceClaimTemplate, or None when it does not exist."""

    def create_claim_template(self, template: dict[str, Any]) -> dict[str, Any]:
        """Create a ResourceClaimTemplate in its metadata's namespace. Raises KubeError (409
        when one of that name exists)."""


# --- API time accounting -------------------------------------------------------------------------

_local = threading.local()


def reset_api_ms() -> None:
    """Start counting this thread's API server time from zero."""
    _local.ms = 0.0


def api_ms() -> float:
    """Milliseconds this thread spent in API server calls since the last reset."""
    return float(getattr(_local, "ms", 0.0))


@contextmanager
def timed() -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        _local.ms = api_ms() + (time.perf_counter() - start) * 1000.0
