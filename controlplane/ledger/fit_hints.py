"""What would make a pending pod fit: the ledger's facts beside "why is my pod pending?".

`controlplane.ledger.why` says where a pod stands; for a pod that waits for room this module adds
three facts a person can act on, read from the committed ledger:

1. the largest free room in the cluster and where it is (node, card): the most free memory on a
   card that takes new slices (healthy, reported, not cordoned, not draining for a mode change,
   on a ready uncordoned node, not held by an exclusive slice, with a free slot);
2. what could free room next: the ledger records no end time for a running pod (Kubernetes'
   `activeDeadlineSeconds` never reaches it), so these are the oldest bindings on the best
   candidate card, the card with bindings and the most free memory, with what each holds there;
3. the pod's namespace quota, with each limit, what is used and what is left; it stands in the
   way when the scheduler refused a node for the quota or when a limit is used up.

The answer does not know the pod's exact request (the decision log keeps the filter's sentence,
not the request), so it states room and holders, not a verdict. Usage comes from
`controlplane.ledger.usage`, the scheduler's own arithmetic. Seven queries whatever the size.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from controlplane import rawsql
from controlplane.ledger import usage as ledger_usage
from controlplane.ledger.models import Card, NamespaceQuota, SchedulingDecision, Slice
from controlplane.ledger.selectors import card_factor
from controlplane.scheduling import FACTOR_ONE, ReasonCode, virtual_mib

Outcome = SchedulingDecision.Outcome
# Outcomes of a pod that waits for room (an invalid request waits for its author instead).
WAITING_FOR_ROOM = (Outcome.UNSCHEDULABLE, Outcome.BIND_FAILED)
HOLDERS = 3


@dataclass(frozen=True, slots=True)
class Room:
    """Free room on one card."""

    node: str
    card: str
    index: int
    model: str
    mode: str
    free_memory_mib: int
    free_cores: int
    free_slots: int
    occupied: bool  # some pod holds part of it: waiting for that pod can help here


@dataclass(frozen=True, slots=True)
class Holder:
    """A pod holding part of the candidate card: what it would free by ending."""

    namespace: str
    name: str
    memory_mib: int
    cores: int
    since: datetime


@dataclass(frozen=True, slots=True)
class QuotaLimit:
    """One limit of a namespace quota beside its use."""

    resource: str  # "gpumem_mib" | "gpucores" | "gpus"
    limit: int
    used: int

    @property
    def left(self) -> int:
        return max(self.limit - self.used, 0)


@dataclass(frozen=True, slots=True)
class QuotaHint:
    namespace: str
    limits: tuple[QuotaLimit, ...]
    in_the_way: bool


@dataclass(frozen=True, slots=True)
class FitHints:
    """The three facts, and sentences that say them (`lines`)."""

    largest_free: Room | None
    candidate: Room | None
    holders: tuple[Holder, ...]
    quota: QuotaHint | None

    @property
    def lines(self) -> tuple[str, ...]:
        return _lines(self)

    def as_dict(self) -> dict[str, Any]:
        """The answer as the REST API returns it."""
        return {
            "largest_free": _room_dict(self.largest_free),
            "candidate": _room_dict(self.candidate),
            "holders_order": "oldest",
            "holders": [
                {
                    "namespace": h.namespace,
                    "name": h.name,
                    "memory_mib": h.memory_mib,
                    "cores": h.cores,
                    "since": h.since,
                }
                for h in self.holders
            ],
            "quota": None
            if self.quota is None
            else {
                "namespace": self.quota.namespace,
                "in_the_way": self.quota.in_the_way,
                "limits": {
                    q.resource: {"limit": q.limit, "used": q.used, "left": q.left}
                    for q in self.quota.limits
                },
            },
            "lines": list(self.lines),
        }


def _room_dict(room: Room | None) -> dict[str, Any] | None:
    if room is None:
        return None
    return {
        "node": room.node,
        "card": room.card,
        "index": room.index,
        "model": room.model,
        "mode": room.mode,
        "free_memory_mib": room.free_memory_mib,
        "free_cores": room.free_cores,
        "free_slots": room.free_slots,
    }


def hints_for(namespace: str, outcome: str, decision: SchedulingDecision | None) -> FitHints | None:
    """The hints for a pod that waits for room (`outcome` from `why`), else None (and no
    queries)."""
    if outcome not in WAITING_FOR_ROOM:
        return None
    rooms = free_rooms()
    largest = max(rooms, key=_room_order, default=None)
    candidate = max((r for r in rooms if r.occupied), key=_room_order, default=None)
    holders = oldest_holders(candidate.card) if candidate is not None else ()
    refused = bool(decision and decision.reason_counts.get(ReasonCode.QUOTA_EXCEEDED))
    return FitHints(largest, candidate, holders, quota_hint(namespace, refused))


def _room_order(room: Room) -> tuple[int, int, int, str]:
    """Most free memory first, then compute, then slots; ties by card UUID (stable answers)."""
    return (room.free_memory_mib, room.free_cores, room.free_slots, room.card)


def free_rooms() -> list[Room]:
    """Every card that takes new slices and has a free slot, with its free room (three
    queries)."""
    rows = rawsql.rows_of(
        Card.objects.filter(
            healthy=True,
            present=True,
            cordoned=False,
            pending_mode="",
            node__ready=True,
            node__cordoned=False,
        )
        .order_by()
        .values_list("id", "uuid", "index", "model", "mode", "node__name", "memory_mib",
                     "compute_units", "slots", "memory_factor", "node__memory_factor")
    )  # fmt: skip
    held = ledger_usage.card_usage()
    rooms = []
    for card_id, uuid, index, model, mode, node, memory, compute, slots, own, dflt in rows:
        used = held.get(card_id, ledger_usage.EMPTY_CARD)
        if used.exclusive or used.slots >= slots:
            continue  # no new slice fits beside an exclusive one, nor without a slot
        # A slice stays on the card in full: room in both budgets (docs/virtual-memory.md),
        # the card's memory less the resident parts, f x memory less the slices' memory.
        free = memory - used.memory_mib
        if mode == Card.Mode.SHARED and (own or dflt) != FACTOR_ONE:
            virtual = virtual_mib(memory, card_factor(own, dflt))
            free = min(memory - used.resident, virtual - used.memory_mib)
        rooms.append(
            Room(node, uuid, index, model, mode, max(free, 0),
                 max(compute - used.cores, 0), slots - used.slots, used.slots > 0)
        )  # fmt: skip
    return rooms


def oldest_holders(card_uuid: str, limit: int = HOLDERS) -> tuple[Holder, ...]:
    """The `limit` pods that have held part of the card longest, with what each holds there
    while it runs (one query)."""
    rows = (
        Slice.objects.filter(card__uuid=card_uuid, active=True)
        .order_by("binding__created_at", "binding_id", "id")
        .values_list("binding_id", "binding__namespace", "binding__name", "init_container",
                     "sidecar", "memory_mib", "compute_percent", "binding__created_at")
    )  # fmt: skip
    held: dict[int, list[Any]] = {}
    for binding_id, namespace, name, init, sidecar, memory, cores, created in rows:
        entry = held.setdefault(binding_id, [namespace, name, 0, 0, created])
        if not init or sidecar:  # what the pod holds while it runs (an init container ends)
            entry[2] += memory
            entry[3] += cores
    ordered = list(held.values())[:limit]
    return tuple(Holder(*entry) for entry in ordered)


def quota_hint(namespace: str, refused: bool) -> QuotaHint | None:
    """The namespace's limits beside its use (three queries), or None without a quota."""
    row = (
        NamespaceQuota.objects.filter(namespace=namespace)
        .values_list("gpumem_mib", "gpucores", "gpus")
        .first()
    )
    if row is None:
        return None
    used = ledger_usage.quota_usage(namespace)
    limits = tuple(
        QuotaLimit(resource, limit, in_use)
        for resource, limit, in_use in zip(
            ("gpumem_mib", "gpucores", "gpus"),
            row,
            (used.memory_mib, used.cores, used.gpus),
            strict=True,
        )
        if limit is not None
    )
    return QuotaHint(namespace, limits, refused or any(q.left == 0 for q in limits))


_UNITS = {
    "gpumem_mib": ("GPU memory", " MiB"),
    "gpucores": ("compute", "%"),
    "gpus": ("slices", ""),
}


def _room_text(room: Room) -> str:
    return (
        f"{room.free_memory_mib} MiB, {room.free_cores}% compute and {room.free_slots} slot"
        f"{'' if room.free_slots == 1 else 's'} free on GPU {room.index} ({room.card}, "
        f"{room.model}, {room.mode}) of node {room.node}"
    )


def _lines(hints: FitHints) -> tuple[str, ...]:
    lines = []
    if hints.largest_free is None:
        lines.append("No card takes a new slice now: every schedulable card is full or held.")
    else:
        lines.append(f"Largest free room: {_room_text(hints.largest_free)}.")
    if hints.candidate is not None and hints.holders:
        held = "; ".join(
            f"{h.namespace}/{h.name} ({h.memory_mib} MiB, {h.cores}%, since "
            f"{h.since:%Y-%m-%d %H:%M} UTC)"
            for h in hints.holders
        )
        lines.append(
            f"Best card to wait for: GPU {hints.candidate.index} of node {hints.candidate.node} "
            f"({hints.candidate.free_memory_mib} MiB free). End times are not known to "
            f"Tessera; its oldest bindings: {held}."
        )
    if hints.quota is not None:
        parts = []
        for q in hints.quota.limits:
            label, unit = _UNITS[q.resource]
            parts.append(f"{label} {q.used} of {q.limit}{unit} used ({q.left}{unit} left)")
        state = "stands in the way" if hints.quota.in_the_way else "leaves room"
        lines.append(
            f"Quota of {hints.quota.namespace} {state}: {'; '.join(parts) or 'no limits'}."
        )
    return tuple(lines)
