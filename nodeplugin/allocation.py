"""The allocation record the control plane writes at bind (docs/allocation.md), parsed strictly.

Pure: no I/O. The plugin trusts a record only when it came from the control plane's REST API
(over the node's authenticated connection) or carries a valid HMAC signature.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any

ANNOTATION = "tessera.io/allocation"
SIGNATURE_ANNOTATION = "tessera.io/allocation-signature"
SIGNATURE_PREFIX = "v1:"
MAX_RECORD_BYTES = 64 * 1024
MAX_DEVICES = 16  # the shim's TESSERA_MAX_DEVICES
# HAMi's nvidia.com/priority: 0 is high, 1 is low (a lower number is a higher priority).
MIN_PRIORITY, MAX_PRIORITY = 0, 1


class AllocationError(ValueError):
    """A record that is malformed, unsigned, forged or for another pod or node."""


# The card's mode (docs/card-modes.md); a record leaves ``mode`` out for a shared card.
SHARED, MIG, MPS, EXCLUSIVE = "shared", "mig", "mps", "exclusive"
MODES = (SHARED, MIG, MPS, EXCLUSIVE)
MAX_MIG_SLICES = 64  # memory slices of a card; today's cards have 8
_MIG_PROFILE = re.compile(r"^[0-9]+g\.[0-9]+gb(\+[a-z0-9]+)*(-[a-z0-9]+)*$")
MIG_KEYS = frozenset({"profile", "start", "size"})


@dataclass(frozen=True)
class MigPlacement:
    """One GPU instance of a MIG profile at one placement on the card's memory slices
    (NVML's ``nvmlGpuInstancePlacement_t``)."""

    profile: str  # NVIDIA's name, e.g. 3g.40gb
    start: int
    size: int


@dataclass(frozen=True)
class SliceDevice:
    uuid: str
    memory_mib: int
    cores: int
    mode: str = SHARED
    mig: MigPlacement | None = None
    # Virtual device memory: the part of memory_mib held on the card; None (the record leaves
    # it out) = all of it. Below memory_mib the rest may spill to host memory.
    resident_mib: int | None = None

    @property
    def oversubscribed(self) -> bool:
        return self.resident_mib is not None and self.resident_mib < self.memory_mib


@dataclass(frozen=True)
class ContainerAllocation:
    name: str
    index: int
    init: bool
    devices: tuple[SliceDevice, ...]
    priority: int | None = None  # None: the pod did not ask for nvidia.com/priority
    # A restartable init container (Kubernetes sidecar): it keeps running beside the containers
    # after it, so the kubelet lists it and never hands its device IDs on to a later container.
    sidecar: bool = False

    @property
    def card_set(self) -> frozenset[str]:
        return frozenset(d.uuid for d in self.devices)


@dataclass(frozen=True)
class Allocation:
    pod_uid: str
    namespace: str
    name: str
    node: str
    containers: tuple[ContainerAllocation, ...]

    def container(self, name: str) -> ContainerAllocation | None:
        for c in self.containers:
            if c.name == name:
                return c
        return None

    def kubelet_order(self) -> list[ContainerAllocation]:
        """Init containers by index, then app containers by index: the kubelet's Allocate order."""
        return sorted(self.containers, key=lambda c: (not c.init, c.index))


def _field(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in obj:
        raise AllocationError(f"allocation record: {where}{key} is missing")
    value = obj[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise AllocationError(f"allocation record: {where}{key} must be an integer")
    if not isinstance(value, kind):
        raise AllocationError(f"allocation record: {where}{key} must be a {kind.__name__}")
    return value


def _mode(d: dict[str, Any], where: str) -> tuple[str, MigPlacement | None]:
    """The device's ``mode`` and ``mig`` keys: absent mode is a shared card; ``mig`` comes with
    mode ``mig`` and with no other."""
    mode = _field(d, "mode", str, where) if "mode" in d else SHARED
    if mode not in MODES:
        raise AllocationError(
            f"allocation record: {where}mode={mode!r} is not one of {', '.join(MODES)}"
        )
    if mode != MIG:
        if "mig" in d:
            raise AllocationError(
                f"allocation record: {where}mig is set on a device of mode {mode!r}; only a "
                "mig device has a MIG placement"
            )
        return mode, None
    if "mig" not in d:
        raise AllocationError(
            f"allocation record: {where}mig is missing; a mig device names its profile and "
            "placement"
        )
    mig = _field(d, "mig", dict, where)
    mwhere = f"{where}mig."
    extra = sorted(set(mig) - MIG_KEYS)
    if extra:
        raise AllocationError(
            f"allocation record: {mwhere}{extra[0]} is not a MIG placement field (want "
            f"{', '.join(sorted(MIG_KEYS))})"
        )
    profile = _field(mig, "profile", str, mwhere)
    start = _field(mig, "start", int, mwhere)
    size = _field(mig, "size", int, mwhere)
    if not _MIG_PROFILE.match(profile):
        raise AllocationError(
            f"allocation record: {mwhere}profile={profile!r} is not a MIG profile name "
            "(e.g. 3g.40gb)"
        )
    if not 0 <= start < MAX_MIG_SLICES:
        raise AllocationError(f"allocation record: {mwhere}start={start} is not 0..63")
    if not 1 <= size <= MAX_MIG_SLICES - start:
        raise AllocationError(
            f"allocation record: {mwhere}size={size} does not fit the card's memory slices "
            f"from start={start}"
        )
    return mode, MigPlacement(profile, start, size)


def parse(data: Any) -> Allocation:
    """Validate a decoded record (version 1). Raises AllocationError naming the field."""
    if not isinstance(data, dict):
        raise AllocationError("allocation record: must be a JSON object")
    version = _field(data, "v", int, "")
    if version != 1:
        raise AllocationError(f"allocation record: version v={version} is not supported (want 1)")
    containers_raw = _field(data, "containers", list, "")
    if not containers_raw:
        raise AllocationError("allocation record: containers is empty")
    containers: list[ContainerAllocation] = []
    seen: set[str] = set()
    for ci, c in enumerate(containers_raw):
        where = f"containers[{ci}]."
        if not isinstance(c, dict):
            raise AllocationError(f"allocation record: containers[{ci}] must be an object")
        name = _field(c, "name", str, where)
        if not name or name in seen:
            raise AllocationError(f"allocation record: {where}name {name!r} is empty or repeated")
        seen.add(name)
        index = _field(c, "index", int, where)
        init = _field(c, "init", bool, where)
        devices_raw = _field(c, "devices", list, where)
        if not devices_raw or len(devices_raw) > MAX_DEVICES:
            raise AllocationError(
                f"allocation record: {where}devices must list 1..{MAX_DEVICES} slices"
            )
        devices: list[SliceDevice] = []
        for di, d in enumerate(devices_raw):
            dwhere = f"{where}devices[{di}]."
            if not isinstance(d, dict):
                raise AllocationError(f"allocation record: {dwhere[:-1]} must be an object")
            uuid = _field(d, "uuid", str, dwhere)
            memory = _field(d, "memory_mib", int, dwhere)
            cores = _field(d, "cores", int, dwhere)
            if not uuid:
                raise AllocationError(f"allocation record: {dwhere}uuid is empty")
            if not 1 <= memory <= 16 * 1024 * 1024:
                raise AllocationError(f"allocation record: {dwhere}memory_mib={memory} is absurd")
            if not 0 <= cores <= 100:
                raise AllocationError(f"allocation record: {dwhere}cores={cores} is not 0..100")
            mode, mig = _mode(d, dwhere)
            resident = None
            if "resident_mib" in d:
                resident = _field(d, "resident_mib", int, dwhere)
                if not 1 <= resident <= memory:
                    raise AllocationError(
                        f"allocation record: {dwhere}resident_mib={resident} is not "
                        f"1..memory_mib ({memory})"
                    )
            devices.append(SliceDevice(uuid, memory, cores, mode, mig, resident))
        if len({d.uuid for d in devices}) != len(devices):
            raise AllocationError(
                f"allocation record: {where}devices repeats a card; each slice is on its own card"
            )
        if index < 0:
            raise AllocationError(f"allocation record: {where}index must be ≥ 0")
        priority = None
        if "priority" in c:
            priority = _field(c, "priority", int, where)
            if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
                raise AllocationError(
                    f"allocation record: {where}priority={priority} is not "
                    f"{MIN_PRIORITY}..{MAX_PRIORITY} (0 = high, 1 = low)"
                )
        sidecar = False
        if "sidecar" in c:
            sidecar = _field(c, "sidecar", bool, where)
            if sidecar and not init:
                raise AllocationError(
                    f"allocation record: {where}sidecar is true on an app container; only an "
                    "init container can be a sidecar"
                )
        containers.append(ContainerAllocation(name, index, init, tuple(devices), priority, sidecar))
    strings = {k: _field(data, k, str, "") for k in ("pod_uid", "namespace", "name", "node")}
    for k, value in strings.items():
        if not value:
            raise AllocationError(f"allocation record: {k} is empty")
    return Allocation(
        pod_uid=strings["pod_uid"],
        namespace=strings["namespace"],
        name=strings["name"],
        node=strings["node"],
        containers=tuple(containers),
    )


def parse_bytes(raw: bytes | str) -> Allocation:
    if len(raw) > MAX_RECORD_BYTES:
        raise AllocationError(f"allocation record: larger than {MAX_RECORD_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AllocationError(f"allocation record: not JSON ({exc})") from None
    return parse(data)


def sign(value: str, key: bytes) -> str:
    """The signature annotation for ``value`` (the control plane's side; used by tests)."""
    mac = hmac.new(key, value.encode(), hashlib.sha256).digest()
    return SIGNATURE_PREFIX + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def verify(value: str, signature: str, key: bytes) -> bool:
    if not key or not signature.startswith(SIGNATURE_PREFIX):
        return False
    return hmac.compare_digest(sign(value, key), signature)


def from_annotations(annotations: dict[str, str], key: bytes) -> Allocation | None:
    """The record from pod annotations when the signature verifies; None when there is none.

    A record without a valid signature is an error (a pod owner cannot forge one); so is a
    signature without a record.
    """
    value = annotations.get(ANNOTATION)
    signature = annotations.get(SIGNATURE_ANNOTATION, "")
    if value is None:
        if signature:
            raise AllocationError(f"{SIGNATURE_ANNOTATION} is set but {ANNOTATION} is missing")
        return None
    if not verify(value, signature, key):
        raise AllocationError(
            f"{ANNOTATION} is not signed by the control plane ({SIGNATURE_ANNOTATION} "
            "missing or wrong): refusing it; only the extender's bind writes a valid record"
        )
    return parse_bytes(value)


def check_identity(alloc: Allocation, namespace: str, name: str, node: str) -> None:
    """Refuse a record for another pod or another node."""
    if (alloc.namespace, alloc.name) != (namespace, name):
        raise AllocationError(
            f"allocation record is for pod {alloc.namespace}/{alloc.name}, but the kubelet "
            f"reports {namespace}/{name}"
        )
    if alloc.node != node:
        raise AllocationError(
            f"allocation record places {namespace}/{name} on node {alloc.node!r}, not on this "
            f"node {node!r}"
        )
