"""What the reconciler needs to know of the cluster, as plain values.

The cluster sources (`real.RealClusterSource`, `embedded.EmbeddedClusterSource`) turn API objects
into these; the reconciler never sees a `kubernetes` object, and tests can hand it lists
directly.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class PodView:
    uid: str
    namespace: str
    name: str
    node_name: str | None
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES


@dataclass(frozen=True, slots=True)
class PodEvent:
    kind: str  # ADDED | MODIFIED | DELETED
    pod: PodView


class WatchExpired(Exception):
    """The resourceVersion is too old (HTTP 410 Gone) or ahead of the API server: relist, then
    watch from the new one."""


class TemporaryError(Exception):
    """The API server (or the network to it) is away for now: retry later with backoff."""


class ClusterSource(Protocol):
    def list_pods(self, page_size: int = 500) -> tuple[list[PodView], str]:
        """Every pod (paginated under the hood) and the list's resourceVersion."""

    def watch_pods(self, resource_version: str, timeout_s: float) -> Iterator[PodEvent]:
        """Pod events after `resource_version` for up to `timeout_s`; raises WatchExpired."""

    def get_pod(self, namespace: str, name: str) -> PodView | None:
        """One pod by name (None when absent); callers compare the UID."""

    def list_node_names(self) -> set[str]:
        """Names of the cluster's nodes."""

    def last_resource_version(self) -> str:
        """The resourceVersion of the last event yielded by watch_pods (or the last list)."""

    def current_resource_version(self) -> str:
        """The API server's resourceVersion now (a one-item list): a resume point ahead of it
        (etcd restored from a backup) is watched from in silence, not refused."""

    def cluster_identity(self) -> str:
        """What tells this cluster from any other: the UID of its `kube-system` namespace ("" when
        it cannot be read). A resume point is only valid on the cluster that issued it."""


def pod_view(obj: Mapping[str, Any]) -> PodView:
    """A v1.Pod as the API server serves it (JSON) -> the few fields the reconciler reads."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    return PodView(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        node_name=spec.get("nodeName") or None,
        phase=str(status.get("phase") or "Pending"),
        annotations=dict(meta.get("annotations") or {}),
    )
