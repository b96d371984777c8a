"""What the reconciler needs to know of the cluster, as plain values.

The cluster sources (`real.RealClusterSource`, `embedded.EmbeddedClusterSource`) turn API objects
into these; the reconciler never sees a `kubernetes` object, and tests can hand it lists
directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from controlplane.scheduling.quantity import parse_quantity

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})

# Tessera's DRA driver and the capacity names of its devices (docs/dra.md section 2; the node
# plugin's `nodeplugin/dra_slices.py` publishes them, and a test holds the two to the same
# names: the control plane does not import the node plugin).
DRA_DRIVER = "gpu.tessera.io"
MEMORY, COMPUTE = "memory", "compute"


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


@dataclass(frozen=True, slots=True)
class DeviceResult:
    """One device of a claim's allocation (`status.allocation.devices.results[]`)."""

    request: str
    driver: str
    pool: str
    device: str
    consumed: Mapping[str, str] = field(default_factory=dict)  # consumedCapacity, as written


@dataclass(frozen=True, slots=True)
class ClaimView:
    """A ResourceClaim: who it is and, once allocated, every device result (of any driver)."""

    uid: str
    namespace: str
    name: str
    allocated: bool
    results: tuple[DeviceResult, ...] = ()


@dataclass(frozen=True, slots=True)
class ClaimEvent:
    kind: str  # ADDED | MODIFIED | DELETED
    claim: ClaimView


@dataclass(frozen=True, slots=True)
class PublishedDevice:
    """A device of Tessera's driver as a ResourceSlice publishes it: which card it is (by the
    `uuid` attribute), its memory, whether claims share it, and its MIG placement if any."""

    uuid: str
    memory_mib: int
    shared: bool
    mig_profile: str = ""
    mig_start: int | None = None
    mig_size: int | None = None


class WatchExpired(Exception):
    """The resourceVersion is too old (HTTP 410 Gone) or ahead of the API server: relist, then
    watch from the new one."""


class TemporaryError(Exception):
    """The API server (or the network to it) is away for now: retry later with backoff."""


class ClaimsUnreadable(Exception):
    """The API server refuses to list ResourceClaims or ResourceSlices (403: the worker lacks the
    grant; 404: no resource.k8s.io/v1): retrying will not help, and the pods' repairs must not
    wait for it."""


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

    def list_claims(self, page_size: int = 500) -> tuple[list[ClaimView], str]:
        """Every ResourceClaim and the list's resourceVersion."""

    def watch_claims(self, resource_version: str, timeout_s: float) -> Iterator[ClaimEvent]:
        """ResourceClaim events after `resource_version` for up to `timeout_s`; raises
        WatchExpired."""

    def last_claims_resource_version(self) -> str:
        """The resourceVersion of the last claim event yielded (or the last claim list)."""

    def published_devices(self) -> dict[tuple[str, str], PublishedDevice]:
        """Tessera's devices in the cluster's ResourceSlices, by (pool, device name)."""


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


def claim_view(obj: Mapping[str, Any]) -> ClaimView:
    """A resource.k8s.io/v1 ResourceClaim as served (JSON) -> who it is and what it got."""
    meta = obj.get("metadata") or {}
    allocation = (obj.get("status") or {}).get("allocation")
    results = ((allocation or {}).get("devices") or {}).get("results") or []
    return ClaimView(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        allocated=bool(allocation),
        results=tuple(
            DeviceResult(
                request=str(r.get("request", "")),
                driver=str(r.get("driver", "")),
                pool=str(r.get("pool", "")),
                device=str(r.get("device", "")),
                consumed={str(k): str(v) for k, v in (r.get("consumedCapacity") or {}).items()},
            )
            for r in results
            if isinstance(r, Mapping)
        ),
    )


def whole_quantity(text: str) -> int | None:
    """A whole-number Kubernetes quantity (`80Gi`, `8448Mi`, `30`) as an integer, read by the
    scheduling core's parser; None for anything it refuses (a fraction, a negative, junk)."""
    try:
        return parse_quantity(text)
    except ValueError:
        return None


def _attribute(attrs: Mapping[str, Any], name: str) -> object:
    """A device attribute's value (`{"string": ...}`, `{"int": ...}`), unqualified or in the
    driver's domain."""
    found = attrs.get(name) or attrs.get(f"{DRA_DRIVER}/{name}") or {}
    return next(iter(found.values()), None) if isinstance(found, Mapping) else None


def published_devices(
    slices: Iterable[Mapping[str, Any]],
) -> dict[tuple[str, str], PublishedDevice]:
    """Tessera's devices of these ResourceSlices by (pool, device). Slices of other drivers, and
    devices without a `uuid` attribute or a whole-MiB memory capacity, are left out: a claim
    that names one is then reported, not mirrored."""
    devices: dict[tuple[str, str], PublishedDevice] = {}
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") != DRA_DRIVER:
            continue
        pool = str((spec.get("pool") or {}).get("name", ""))
        for device in spec.get("devices") or []:
            attrs = device.get("attributes") or {}
            uuid = _attribute(attrs, "uuid")
            memory = ((device.get("capacity") or {}).get(MEMORY) or {}).get("value")
            memory_bytes = whole_quantity(str(memory)) if memory is not None else None
            if not isinstance(uuid, str) or not uuid or not memory_bytes:
                continue
            profile = _attribute(attrs, "profile")
            start, size = _attribute(attrs, "placementStart"), _attribute(attrs, "placementSize")
            mig = isinstance(profile, str) and isinstance(start, int) and isinstance(size, int)
            devices[(pool, str(device.get("name", "")))] = PublishedDevice(
                uuid=uuid,
                memory_mib=memory_bytes >> 20,
                shared=bool(device.get("allowMultipleAllocations")),
                mig_profile=str(profile) if mig else "",
                mig_start=int(start) if mig else None,  # type: ignore[arg-type]
                mig_size=int(size) if mig else None,  # type: ignore[arg-type]
            )
    return devices
