"""Why a pod waits on a ResourceClaim (DRA mode): Tessera's own answer beside the scheduler's.

kube-scheduler allocates claims itself and says only that no node fits ("cannot allocate all
claims"). Tessera reads what the node plugins published (the ResourceSlices of
`gpu.tessera.io`) and what the allocated claims consume, and answers per request of a claim
that is not allocated: how much is left on each card that the request's class selects, which
cards come closest, what would make it fit, and whether the namespace's quota stands in the way
(docs/dra.md, *Why a claim waits*).

The caller reads the objects from the API server and hands them in as JSON; the only query is
the namespace's quota and usage (`claim_quota`). The room per card is the consumable-capacity
sum the allocator keeps: the sum of the allocated results' `consumedCapacity` per device; a
device that does not allow several allocations is taken whole by one result.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.ledger import selectors
from controlplane.ledger.claim_quota import namespace_claim_usage
from controlplane.scheduling import RequestError, check_quota, parse_quantity
from controlplane.scheduling.claim_demand import (
    COMPUTE,
    DRIVER,
    MEMORY,
    MIB,
    MIG_CLASS,
    MPS_CLASS,
    SHARED_CLASS,
    SLOTS,
    DeviceAsk,
    parse_claim_spec,
)

# The card modes each class selects (deploy/helm/tessera/templates/deviceclass.yaml).
CLASS_MODES = {SHARED_CLASS: ("shared", "exclusive"), MPS_CLASS: ("mps",), MIG_CLASS: ("mig",)}
CLOSEST = 3  # cards named per request


@dataclass(frozen=True, slots=True)
class CardRoom:
    """One published card and what the allocated claims leave of it."""

    node: str
    device: str
    uuid: str
    mode: str
    memory_mib: int
    compute: int
    slots: int
    free_memory_mib: int
    free_compute: int
    free_slots: int
    shared: bool
    tainted: bool

    def shortfall(self, ask: DeviceAsk) -> tuple[int, int, int]:
        """(MiB, percent, slots) this card lacks for one device of ``ask``; all 0: it fits."""
        memory = self.memory_mib if ask.memory_mib is None else ask.memory_mib
        return (
            max(0, memory - self.free_memory_mib),
            max(0, ask.compute - self.free_compute),
            max(0, 1 - self.free_slots),
        )

    def distance(self, ask: DeviceAsk) -> float:
        """How far from fitting, each dimension as a share of the card (0: fits)."""
        memory, compute, slots = self.shortfall(ask)
        return memory / max(self.memory_mib, 1) + compute / 100 + slots + (1 if self.tainted else 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node, "device": self.device, "uuid": self.uuid, "mode": self.mode,
            "memory_mib": self.memory_mib, "free_memory_mib": self.free_memory_mib,
            "free_compute": self.free_compute, "slots": self.slots, "free_slots": self.free_slots,
            "tainted": self.tainted,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class RequestAnswer:
    """One request of a waiting claim: how many cards fit, the closest ones, what would fit."""

    request: str
    device_class: str
    count: int
    memory_mib: int | None
    compute: int
    candidates: int
    fitting: int
    closest: tuple[CardRoom, ...]
    to_fit: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "request": self.request, "device_class": self.device_class, "count": self.count,
            "memory_mib": self.memory_mib, "compute": self.compute,
            "candidates": self.candidates, "fitting": self.fitting,
            "closest": [c.as_dict() for c in self.closest], "to_fit": self.to_fit,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class ClaimAnswer:
    """A claim the pod waits on: allocated or not, and if not, why (per request) and the quota."""

    name: str
    allocated: bool
    requests: tuple[RequestAnswer, ...]
    quota: str
    error: str = ""

    @property
    def text(self) -> str:
        if self.error:
            return f"Claim {self.name}: {self.error}"
        if self.allocated:
            return f"Claim {self.name} is allocated."
        parts = [f"Claim {self.name} is not allocated."]
        for r in self.requests:
            parts.append(_request_text(r))
        if self.quota:
            parts.append(f"Quota: {self.quota}.")
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "allocated": self.allocated,
            "requests": [r.as_dict() for r in self.requests],
            "quota": self.quota or None,
            "error": self.error or None,
            "text": self.text,
        }


def _request_text(r: RequestAnswer) -> str:
    memory = "the whole card" if r.memory_mib is None else f"{r.memory_mib} MiB"
    devices = f"{r.count} card(s)" if r.count > 1 else "a card"
    head = (
        f"Request {r.request} asks {devices} of class {r.device_class} with {memory} and "
        f"{r.compute}% compute: {r.fitting} of {r.candidates} card(s) could hold one now."
    )
    closest = "; ".join(
        f"{c.device} ({c.uuid}) on node {c.node}: {c.free_memory_mib} of {c.memory_mib} MiB, "
        f"{c.free_compute}% compute and {c.free_slots} of {c.slots} slot(s) free"
        + (", tainted unhealthy" if c.tainted else "")
        for c in r.closest
    )
    return f"{head} Closest: {closest}. To fit: {r.to_fit}" if closest else f"{head} {r.to_fit}"


def card_rooms(
    slices: Iterable[Mapping[str, Any]], claims: Iterable[Mapping[str, Any]]
) -> list[CardRoom]:
    """Every card of Tessera's published slices with what the allocated claims leave of it."""
    used: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("driver") != DRIVER:
                continue
            held = used[(str(result.get("pool")), str(result.get("device")))]
            consumed = result.get("consumedCapacity")
            if isinstance(consumed, Mapping):
                held[0] += _amount(consumed.get(MEMORY)) // MIB
                held[1] += _amount(consumed.get(COMPUTE))
                held[2] += 1
            else:
                held[3] = 1  # a device allocated whole
    rooms = []
    for piece in slices:
        spec = piece.get("spec") or {}
        if spec.get("driver") != DRIVER:
            continue
        pool = str((spec.get("pool") or {}).get("name") or spec.get("nodeName") or "")
        node = str(spec.get("nodeName") or pool)
        for device in spec.get("devices") or []:
            rooms.append(_room(node, pool, device, used.get((pool, str(device.get("name"))))))
    return rooms


def _room(node: str, pool: str, device: Mapping[str, Any], held: list[int] | None) -> CardRoom:
    attrs = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    memory = _amount((capacity.get(MEMORY) or {}).get("value")) // MIB
    compute = _amount((capacity.get(COMPUTE) or {}).get("value")) or 100
    shared = device.get("allowMultipleAllocations") is True
    slots = _amount((capacity.get(SLOTS) or {}).get("value")) if shared else 1
    held = held or [0, 0, 0, 0]
    whole = held[3] or (not shared and held[2])
    return CardRoom(
        node=node,
        device=str(device.get("name")),
        uuid=str((attrs.get("uuid") or {}).get("string") or ""),
        mode=str((attrs.get("mode") or {}).get("string") or ""),
        memory_mib=memory,
        compute=compute,
        slots=slots,
        free_memory_mib=0 if whole else max(0, memory - held[0]),
        free_compute=0 if whole else max(0, compute - held[1]),
        free_slots=0 if whole else max(0, slots - held[2]),
        shared=shared,
        tainted=any(
            t.get("effect") in ("NoSchedule", "NoExecute") for t in device.get("taints") or []
        ),
    )


def _amount(value: object) -> int:
    try:
        return parse_quantity(value) if value is not None else 0
    except ValueError:
        return 0


def answer_request(ask: DeviceAsk, rooms: list[CardRoom]) -> RequestAnswer:
    """How the published cards stand against one request (no queries)."""
    modes = CLASS_MODES.get(ask.device_class, ())
    candidates = [r for r in rooms if r.mode in modes]
    fitting = [r for r in candidates if not r.tainted and r.shortfall(ask) == (0, 0, 0)]
    ranked = sorted(candidates, key=lambda r: (r.distance(ask), -r.free_memory_mib, r.uuid))
    to_fit = _to_fit(ask, candidates, fitting, ranked)
    return RequestAnswer(
        ask.request, ask.device_class, ask.count, ask.memory_mib, ask.compute,
        len(candidates), len(fitting), tuple(ranked[:CLOSEST]), to_fit,
    )  # fmt: skip


def _to_fit(
    ask: DeviceAsk, candidates: list[CardRoom], fitting: list[CardRoom], ranked: list[CardRoom]
) -> str:
    if not candidates:
        return (
            f"no node publishes a card of class {ask.device_class}; put a card in that mode "
            "(docs/card-modes.md) or ask another class"
        )
    if len(fitting) >= ask.count:
        return (
            f"{len(fitting)} card(s) hold it now; the scheduler's reason says what else stops it "
            "(node selectors, constraints, a card per node)"
        )
    if fitting:
        return (
            f"only {len(fitting)} card(s) hold one device and it asks {ask.count}: ask fewer, "
            "or wait for claims on other cards to end"
        )
    healthy = [r for r in ranked if not r.tainted]
    if not healthy:
        return (
            f"every card of class {ask.device_class} is tainted unhealthy (taint "
            f"{DRIVER}/unhealthy); wait for one to recover"
        )
    best = healthy[0]
    memory, compute, slots = best.shortfall(ask)
    asks = []
    if memory:
        whole = " (it names no memory, so it takes a whole card)" if ask.memory_mib is None else ""
        asks.append(f"at most {max(r.free_memory_mib for r in healthy)} MiB{whole}")
    if compute:
        asks.append(f"at most {max(r.free_compute for r in healthy)}% compute")
    wait = (
        f"{memory} MiB" if memory else "",
        f"{compute}% compute" if compute else "",
        f"{slots} slot" if slots else "",
    )
    freed = ", ".join(w for w in wait if w)
    where = f"{best.device} ({best.uuid}) on node {best.node}"
    if asks:
        return f"ask {' and '.join(asks)}, or wait until claims on {where} free {freed}"
    return f"wait until claims on {where} free {freed}"


def answer_claim(
    claim: Mapping[str, Any],
    rooms: list[CardRoom],
    namespace_claims: list[Mapping[str, Any]],
    whole_card_mib: int,
) -> ClaimAnswer:
    """A claim the pod waits on: allocated, or per request why not, and the quota in the way
    (two to four queries, none when allocated)."""
    name = str((claim.get("metadata") or {}).get("name") or "")
    if (claim.get("status") or {}).get("allocation"):
        return ClaimAnswer(name, True, (), "")
    try:
        ask = parse_claim_spec(claim.get("spec"))
    except RequestError as exc:
        return ClaimAnswer(name, False, (), "", f"its spec can never be allocated: {exc}")
    # a prioritized list is answered for its first alternative of Tessera's classes
    requests = tuple(
        answer_request(next(a for a in alternatives if a.device_class), rooms)
        for alternatives in ask.requests
    )
    namespace = str((claim.get("metadata") or {}).get("namespace") or "")
    quota = ""
    limits = selectors.quota_limits(namespace)
    if limits is not None and ask.tessera:
        uid = (claim.get("metadata") or {}).get("uid")
        others = [c for c in namespace_claims if (c.get("metadata") or {}).get("uid") != uid]
        usage = namespace_claim_usage(namespace, others, whole_card_mib)
        refusal = check_quota(namespace, limits, usage.total, ask.demand(whole_card_mib))
        quota = refusal.message if refusal is not None else ""
    return ClaimAnswer(name, False, requests, quota)
