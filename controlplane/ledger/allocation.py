"""The allocation record (docs/allocation.md): its JSON, its HMAC signature, the key, and
reading a signed record back.

Bind writes the record onto the pod (two annotations through the Binding); node plugins and the
reconciler trust a pod's allocation only when its signature verifies: a pod's owner can write
annotations but cannot sign them.

The key is read once per process. Where it comes from:

1. `TESSERA_ALLOCATION_KEY_FILE`: a file holding the key (a mounted Kubernetes Secret). The
   key is the file's bytes with surrounding whitespace stripped, so `echo key > file` and
   `printf key > file` sign alike; node plugins read it the same way.
2. `TESSERA_ALLOCATION_KEY`: the key itself, for dev and test only (refused in production,
   where an environment variable leaks into `kubectl describe` and crash reports).
3. Neither, outside production: a random key generated once into `<LOCAL_DIR>/allocation.key`
   (mode 0600) and reused, so `make run` signs without any set-up.

Production (`TESSERA_ENV=production`) with no key file refuses to start a process that serves
the extender (see `check_production_key`, called from the app's `ready()`).
"""

# No `from __future__ import annotations` here: it would bind the name `annotations`, which is
# this module's public function (bind and the tests call `allocation.annotations`).
import base64
import hashlib
import hmac
import json
import os
import secrets
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

ANNOTATION = "tessera.io/allocation"
SIGNATURE_ANNOTATION = "tessera.io/allocation-signature"
SIGNATURE_PREFIX = "v1:"
VERSION = 1
MIN_KEY_BYTES = 32

_lock = threading.Lock()
_key: bytes | None = None


def _read_key_file(path: str) -> bytes:
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ImproperlyConfigured(
            f"TESSERA_ALLOCATION_KEY_FILE={path!r} cannot be read: {exc.strerror}"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise ImproperlyConfigured(
            f"TESSERA_ALLOCATION_KEY_FILE={path!r} holds {len(key)} bytes; the allocation key "
            f"needs at least {MIN_KEY_BYTES} (e.g. `openssl rand -base64 48`)"
        )
    return key


def _generated_dev_key() -> bytes:
    path = Path(settings.LOCAL_DIR) / "allocation.key"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # O_EXCL: two processes starting at once must agree on one key, not overwrite each other.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_key_file(str(path))
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_urlsafe(48) + "\n")
    return _read_key_file(str(path))


def load_key() -> bytes:
    """The key from settings (file, then variable, then the generated dev key)."""
    knobs = settings.TESSERA
    if knobs.get("ALLOCATION_KEY_FILE"):
        return _read_key_file(knobs["ALLOCATION_KEY_FILE"])
    if settings.PRODUCTION:
        raise ImproperlyConfigured(
            "TESSERA_ENV=production needs TESSERA_ALLOCATION_KEY_FILE: the path of the allocation "
            "signing key mounted from a Kubernetes Secret (docs/extender.md). "
            "TESSERA_ALLOCATION_KEY and generated keys are for dev and test only."
        )
    raw = knobs.get("ALLOCATION_KEY") or ""
    if raw:
        key = raw.strip().encode("utf-8")
        if len(key) < MIN_KEY_BYTES:
            raise ImproperlyConfigured(
                f"TESSERA_ALLOCATION_KEY holds {len(key)} bytes; it needs at least {MIN_KEY_BYTES}"
            )
        return key
    return _generated_dev_key()


def key() -> bytes:
    """The process's signing key, loaded on first use."""
    global _key
    if _key is None:
        with _lock:
            if _key is None:
                _key = load_key()
    return _key


def reset_key() -> None:
    """Forget the loaded key (tests that change the key settings call this)."""
    global _key
    with _lock:
        _key = None


def check_production_key() -> None:
    """Refuse to start a production extender without its key (called from AppConfig.ready)."""
    if settings.PRODUCTION and settings.TESSERA.get("SERVE_EXTENDER"):
        load_key()


# --- the record ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Device:
    uuid: str
    card_index: int
    memory_mib: int
    cores: int
    mode: str = "shared"  # the card's mode (docs/card-modes.md)
    mig: tuple[str, int, int] | None = None  # a MIG instance: (profile, start, size)
    resident_mib: int | None = None  # below memory_mib: the slice may spill (virtual memory)


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    name: str
    index: int
    init: bool
    devices: tuple[Device, ...]
    sidecar: bool = False  # an init container that keeps running (restartPolicy: Always)
    priority: int | None = None  # nvidia.com/priority, None when the pod did not ask


class SliceRow(NamedTuple):
    """One (container, card) slice of a binding as the record reads it. `SLICE_COLUMNS` is
    derived from these fields, so a query's columns and this order cannot drift apart."""

    container_name: str
    container_index: int
    init: bool
    card_uuid: str
    card_index: int
    memory_mib: int
    cores: int
    sidecar: bool
    priority: int | None  # nvidia.com/priority, None when the pod did not ask
    mode: str  # the card's mode
    mig_profile: str  # blank, and the placement None, on other than MIG cards
    mig_start: int | None
    mig_size: int | None
    resident_mib: int | None = None  # None: the slice stays on the card in full


# The ORM path of each field that is not a Slice column of the same name.
_SLICE_PATHS = {
    "init": "init_container",
    "card_uuid": "card__uuid",
    "card_index": "card__index",
    "cores": "compute_percent",
    "mode": "card__mode",
}
# `values_list(*SLICE_COLUMNS)` reads a `SliceRow`'s fields, in order (`SliceRow._make`).
SLICE_COLUMNS = tuple(_SLICE_PATHS.get(f, f) for f in SliceRow._fields)


def containers_of(rows: Iterable[SliceRow]) -> list[ContainerAllocation]:
    """The record's containers from one binding's slices, one row per (container, card)."""
    containers: dict[tuple[bool, int], tuple[str, bool, int | None, list[Device]]] = {}
    for row in rows:
        entry = containers.setdefault(
            (row.init, row.container_index), (row.container_name, row.sidecar, row.priority, [])
        )
        profile, size = row.mig_profile, row.mig_size
        mig = (profile, row.mig_start or 0, size) if profile and size else None
        entry[3].append(
            Device(
                row.card_uuid, row.card_index, row.memory_mib, row.cores, row.mode, mig,
                row.resident_mib,
            )
        )  # fmt: skip
    return [
        ContainerAllocation(name, index, init, tuple(devices), sidecar, priority)
        for (init, index), (name, sidecar, priority, devices) in containers.items()
    ]


def in_visible_order(devices: Iterable[Device]) -> list[Device]:
    """A container's cards in the order it sees them (CUDA_VISIBLE_DEVICES): by card index."""
    return sorted(devices, key=lambda d: (d.card_index, d.uuid))


def _device(d: Device) -> dict[str, Any]:
    out: dict[str, Any] = {"cores": d.cores, "memory_mib": d.memory_mib, "uuid": d.uuid}
    # `mode` and `mig` only when they say something: a shared device reads as before
    # (docs/card-modes.md, "The allocation record").
    if d.mode != "shared":
        out["mode"] = d.mode
    if d.mig is not None:
        profile, start, size = d.mig
        out["mig"] = {"profile": profile, "size": size, "start": start}
    # Only below the slice's memory (docs/virtual-memory.md): the record of a slice that stays
    # on the card in full, every pod without the opt-in, reads byte for byte as before.
    if d.resident_mib is not None and d.resident_mib < d.memory_mib:
        out["resident_mib"] = d.resident_mib
    return out


def _container(c: ContainerAllocation) -> dict[str, Any]:
    out: dict[str, Any] = {
        "devices": [_device(d) for d in in_visible_order(c.devices)],
        "index": c.index,
        "init": c.init,
        "name": c.name,
    }
    # Only when they say something: a record without them reads as before (docs/allocation.md).
    if c.sidecar:
        out["sidecar"] = True
    if c.priority is not None:
        out["priority"] = c.priority
    return out


def allocation_record(
    pod_uid: str, namespace: str, name: str, node: str, containers: Iterable[ContainerAllocation]
) -> dict[str, Any]:
    """The version-1 allocation object. Init containers (sidecars among them) first, then by
    index; each container's devices by the card's index on the node: the order CUDA enumerates
    them inside the container, so device ordinal i is `devices[i]` (TESSERA_DEVICE_*_LIMIT_<i>).
    `sidecar` and `priority` appear on a container only when set."""
    ordered = sorted(containers, key=lambda c: (not c.init, c.index))
    return {
        "containers": [_container(c) for c in ordered],
        "name": name,
        "namespace": namespace,
        "node": node,
        "pod_uid": pod_uid,
        "v": VERSION,
    }


def encode(record: dict[str, Any]) -> str:
    """Compact JSON, keys sorted: the exact bytes the signature covers."""
    return json.dumps(record, separators=(",", ":"), sort_keys=True, ensure_ascii=True)


def sign(value: str, signing_key: bytes | None = None) -> str:
    """`v1:` + unpadded base64url of HMAC-SHA256(key, value's UTF-8 bytes)."""
    mac = hmac.new(signing_key or key(), value.encode("utf-8"), hashlib.sha256).digest()
    return SIGNATURE_PREFIX + base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")


def verify(value: str, signature: str, signing_key: bytes | None = None) -> bool:
    """Whether `signature` is ours for `value` (constant-time; what a node plugin does)."""
    return hmac.compare_digest(sign(value, signing_key), signature)


def annotations(record: dict[str, Any]) -> dict[str, str]:
    """The two pod annotations bind writes through the Binding."""
    value = encode(record)
    return {ANNOTATION: value, SIGNATURE_ANNOTATION: sign(value)}


# --- reading a signed record back (the reconciler adopts what the ledger lacks) ---------------


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    uuid: str
    memory_mib: int
    cores: int
    mode: str = "shared"
    mig: tuple[str, int, int] | None = None  # (profile, start, size)
    resident_mib: int | None = None  # None: resident in full


@dataclass(frozen=True, slots=True)
class AllocatedContainer:
    name: str
    index: int
    init: bool
    devices: tuple[AllocatedDevice, ...]
    sidecar: bool = False
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class Allocation:
    """A verified allocation record."""

    pod_uid: str
    namespace: str
    name: str
    node: str
    containers: tuple[AllocatedContainer, ...]


class InvalidAllocation(ValueError):
    """A pod's allocation annotations that are unsigned, altered or malformed (the reason)."""


def verify_allocation(pod_annotations: Mapping[str, str]) -> Allocation:
    """Parse a pod's allocation annotation after checking the control plane's signature.

    Raises InvalidAllocation naming what is wrong; an unsigned or altered record is never
    adopted.
    """
    value = pod_annotations.get(ANNOTATION, "")
    signature = pod_annotations.get(SIGNATURE_ANNOTATION, "")
    if not signature:
        raise InvalidAllocation("the allocation carries no signature")
    if not verify(value, signature):
        raise InvalidAllocation("the allocation's signature does not verify")
    try:
        record: dict[str, Any] = json.loads(value)
        if record.get("v") != VERSION:
            raise InvalidAllocation(f"allocation version {record.get('v')!r} is not supported")
        return Allocation(
            pod_uid=str(record["pod_uid"]),
            namespace=str(record["namespace"]),
            name=str(record["name"]),
            node=str(record["node"]),
            containers=tuple(
                AllocatedContainer(
                    name=str(c["name"]),
                    index=int(c["index"]),
                    init=bool(c["init"]),
                    devices=tuple(_allocated_device(d) for d in c["devices"]),
                    sidecar=bool(c.get("sidecar", False)),
                    priority=None if c.get("priority") is None else int(c["priority"]),
                )
                for c in record["containers"]
            ),
        )
    except InvalidAllocation:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidAllocation(f"the allocation is malformed: {exc!r}") from None


_MODES = ("shared", "mig", "mps", "exclusive")


def _allocated_device(d: Mapping[str, Any]) -> AllocatedDevice:
    """One device object of a record; `mode` and `mig` as docs/card-modes.md says."""
    mode = d.get("mode", "shared")
    if mode not in _MODES:
        raise InvalidAllocation(f"device mode {mode!r} is not one of {', '.join(_MODES)}")
    mig = d.get("mig")
    if (mig is not None) != (mode == "mig"):
        raise InvalidAllocation(f"device mig must be present exactly on a mig device ({mode})")
    placement = None
    if mig is not None:
        if not isinstance(mig, Mapping):
            raise InvalidAllocation("device mig must be an object")
        placement = (str(mig["profile"]), int(mig["start"]), int(mig["size"]))
    memory = int(d["memory_mib"])
    resident = d.get("resident_mib")
    if resident is not None and (
        isinstance(resident, bool) or not isinstance(resident, int) or not 1 <= resident <= memory
    ):
        raise InvalidAllocation(
            f"device resident_mib must be an integer from 1 to memory_mib ({memory}), got "
            f"{resident!r}"
        )
    return AllocatedDevice(
        str(d["uuid"]), memory, int(d["cores"]), str(mode), placement,
        None if resident is None or resident == memory else resident,
    )  # fmt: skip
