"""What a ResourceClaim asks of Tessera's cards, in quota units (docs/dra.md, *Quotas*).

A claim's spec (or the spec a ResourceClaimTemplate stamps out) is read request by request.
Only requests naming one of Tessera's device classes count; any other class is another driver's
and contributes nothing. Per device a request consumes what the slices' request policies give
(docs/dra.md section 2): the memory it names, rounded up to whole MiB (at least 1 MiB), else the
policy's default, the whole card; the compute percent it names, else 0; always one slot.

Admission sees no allocation, so what it counts is a lower bound of what any allocation takes:
the whole card is valued at the smallest card that could serve it, ``allocationMode: All``
counts one device, and a prioritized list (``firstAvailable``) counts its least demanding
alternative. Once allocated, the claim's ledger row holds the exact consumed capacity.

A spec that no Tessera card could ever serve (compute over 100, a second slot, a capacity the
cards do not publish, a count below one) is refused with the field and the reason, as
`parse_pod` refuses a pod.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from controlplane.scheduling.quantity import parse_quantity
from controlplane.scheduling.quota import QuotaUsage
from controlplane.scheduling.request import RequestError

DRIVER = "gpu.tessera.io"
# The chart's DeviceClasses (deploy/helm/tessera/templates/deviceclass.yaml).
SHARED_CLASS = DRIVER
MPS_CLASS = f"mps.{DRIVER}"
MIG_CLASS = f"mig.{DRIVER}"
TESSERA_CLASSES = (SHARED_CLASS, MPS_CLASS, MIG_CLASS)
# Capacity names of the published devices (nodeplugin/dra_slices.py).
MEMORY, COMPUTE, SLOTS = "memory", "compute", "slots"
CAPACITIES = (MEMORY, COMPUTE, SLOTS)
MIB = 1 << 20
MAX_COMPUTE = 100


@dataclass(frozen=True, slots=True)
class DeviceAsk:
    """One request (or one alternative of a prioritized list) naming a Tessera class.

    ``memory_mib`` is per device, ``None`` when the request names no memory (the policy's
    default: the whole card). ``admin``: admin access, which consumes nothing.
    """

    request: str
    device_class: str
    count: int
    memory_mib: int | None
    compute: int
    admin: bool = False

    def demand(self, whole_card_mib: int) -> QuotaUsage:
        """What this ask counts against a quota, the whole card valued at ``whole_card_mib``."""
        if self.admin:
            return QuotaUsage()
        memory = whole_card_mib if self.memory_mib is None else self.memory_mib
        return QuotaUsage(self.count * memory, self.count * self.compute, self.count)


@dataclass(frozen=True, slots=True)
class ClaimAsk:
    """A claim's requests that name Tessera's classes: one tuple of alternatives per request
    (one alternative for an ``exactly`` request)."""

    requests: tuple[tuple[DeviceAsk, ...], ...]

    @property
    def tessera(self) -> bool:
        return bool(self.requests)

    def demand(self, whole_card_mib: int) -> QuotaUsage:
        """The least any allocation of the claim counts against its namespace's quota."""
        total = QuotaUsage()
        for alternatives in self.requests:
            total = total + _least(a.demand(whole_card_mib) for a in alternatives)
        return total


def _least(demands: Iterable[QuotaUsage]) -> QuotaUsage:
    found = list(demands)
    return QuotaUsage(
        min(d.memory_mib for d in found), min(d.cores for d in found), min(d.gpus for d in found)
    )


def parse_claim_spec(spec: object, where: str = "spec") -> ClaimAsk:
    """A ResourceClaimSpec (``spec`` of a claim) -> its Tessera asks; RequestError when bad."""
    if spec is None:
        return ClaimAsk(())
    if not isinstance(spec, Mapping):
        raise RequestError(where, "must be an object (a ResourceClaimSpec)")
    devices = spec.get("devices")
    if devices is None:
        return ClaimAsk(())
    if not isinstance(devices, Mapping):
        raise RequestError(f"{where}.devices", "must be an object")
    raw = devices.get("requests")
    if raw is None:
        return ClaimAsk(())
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise RequestError(f"{where}.devices.requests", "must be a list")
    found: list[tuple[DeviceAsk, ...]] = []
    for i, request in enumerate(raw):
        path = f"{where}.devices.requests[{i}]"
        if not isinstance(request, Mapping):
            raise RequestError(path, "must be an object (a DeviceRequest)")
        name = str(request.get("name") or "")
        exactly, first = request.get("exactly"), request.get("firstAvailable")
        if exactly is not None and first is not None:
            raise RequestError(path, "sets both exactly and firstAvailable; set one")
        if exactly is not None:
            ask = _device_ask(exactly, name, f"{path}.exactly")
            if ask is not None:
                found.append((ask,))
        elif first is not None:
            if not isinstance(first, Sequence) or isinstance(first, str) or not first:
                raise RequestError(f"{path}.firstAvailable", "must be a non-empty list")
            alternatives = [
                _device_ask(sub, name, f"{path}.firstAvailable[{j}]") for j, sub in enumerate(first)
            ]
            if any(a is not None for a in alternatives):
                # another driver's alternative may be the one allocated: it counts nothing here
                none = DeviceAsk(name, "", 0, 0, 0)
                found.append(tuple(a if a is not None else none for a in alternatives))
        else:
            raise RequestError(path, "sets neither exactly nor firstAvailable")
    return ClaimAsk(tuple(found))


def parse_template_spec(template_spec: object) -> ClaimAsk:
    """A ResourceClaimTemplate's ``spec`` (metadata and the claim's ``spec``) -> its asks."""
    if template_spec is None:
        return ClaimAsk(())
    if not isinstance(template_spec, Mapping):
        raise RequestError("spec", "must be an object (a ResourceClaimTemplateSpec)")
    return parse_claim_spec(template_spec.get("spec"), "spec.spec")


def _device_ask(raw: object, name: str, path: str) -> DeviceAsk | None:
    if not isinstance(raw, Mapping):
        raise RequestError(path, "must be an object")
    if raw.get("name"):  # a subrequest: the kubelet and the results name it <request>/<sub>
        name = f"{name}/{raw['name']}"
    device_class = raw.get("deviceClassName")
    if device_class not in TESSERA_CLASSES:
        return None
    assert isinstance(device_class, str)
    mode = raw.get("allocationMode") or "ExactCount"
    if mode == "ExactCount":
        count = _whole(raw.get("count", 1), f"{path}.count")
        if count < 1:
            raise RequestError(f"{path}.count", f"is {count}; a request takes at least 1 device")
    elif mode == "All":
        count = 1  # every matching device: at least one
    else:
        raise RequestError(f"{path}.allocationMode", f"{mode!r} is not ExactCount or All")
    memory, compute = _capacity(raw.get("capacity"), f"{path}.capacity.requests")
    return DeviceAsk(name, device_class, count, memory, compute, raw.get("adminAccess") is True)


def _capacity(raw: object, path: str) -> tuple[int | None, int]:
    if raw is None:
        return None, 0
    if not isinstance(raw, Mapping):
        raise RequestError(path.rsplit(".", 1)[0], "must be an object")
    requests = raw.get("requests")
    if requests is None:
        return None, 0
    if not isinstance(requests, Mapping):
        raise RequestError(path, "must be a map of capacity name to quantity")
    for key in requests:
        if key not in CAPACITIES:
            raise RequestError(
                f"{path}.{key}",
                f"Tessera's cards publish no capacity {key!r}, so no card could serve it; "
                f"they offer {', '.join(CAPACITIES)}",
            )
    memory = None
    if MEMORY in requests:
        amount = _whole(requests[MEMORY], f"{path}.{MEMORY}")
        memory = max(1, -(-amount // MIB))  # the policy's 1Mi minimum and 1Mi step
    compute = 0
    if COMPUTE in requests:
        compute = _whole(requests[COMPUTE], f"{path}.{COMPUTE}")
        if compute > MAX_COMPUTE:
            raise RequestError(
                f"{path}.{COMPUTE}",
                f"is {compute}; compute is a percent of one card, at most {MAX_COMPUTE}",
            )
    if SLOTS in requests and _whole(requests[SLOTS], f"{path}.{SLOTS}") != 1:
        raise RequestError(
            f"{path}.{SLOTS}",
            "must be 1 (or left out): every allocation takes exactly one slot of a card; "
            "ask count for more devices",
        )
    return memory, compute


def _whole(value: object, path: str) -> int:
    try:
        return parse_quantity(value)
    except ValueError as exc:
        raise RequestError(path, str(exc)) from None
