"""Reads for the extender, the webhook and the allocation API, in a fixed number of queries."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db.models import Count, Max, Q

from controlplane.extender.signing import ContainerAllocation, Device, allocation_record
from controlplane.ledger import sql as ledger_sql
from controlplane.ledger.models import (
    Card,
    Node,
    PodBinding,
    SchedulingDecision,
    Slice,
)
from controlplane.scheduling import QuotaLimits


def changes_since(since: datetime) -> list[tuple[str, str | None, str | None]]:
    """What changed at or after `since` (1 query): (node, pod UID, phase) per binding row,
    (node, None, None) per node or card row.

    The snapshot cache's incremental refresh; a binding's slices change only together with the
    binding row (reserve, release), so its `updated_at` covers them.
    """
    return ledger_sql.changes_since(since)


def ledger_counts() -> tuple[int, int]:
    """(nodes, cards) in the ledger: deletions are the one change `updated_at` cannot show."""
    return ledger_sql.ledger_counts()


def all_quota_limits() -> dict[str, QuotaLimits]:
    """Every namespace quota (one query)."""
    return ledger_sql.quota_limits()


@dataclass(frozen=True, slots=True)
class ExpiredReservation:
    """A reservation whose Binding was never confirmed in time (the process may have died)."""

    pod_uid: str
    namespace: str
    name: str
    node: str | None
    reserved_at: datetime | None
    deadline: datetime


def expired_reservations(now: datetime, limit: int = 1000) -> list[ExpiredReservation]:
    """Reservations past their deadline, oldest first (one query), for the reconciler.

    A reservation is written before the Binding call; if the process dies in between, nothing
    else will ever confirm or release it. The reconciler asks the API server whether the pod was
    bound (then `confirm_binding`) or not (then `release_binding(..., failed=True)`).
    """
    rows = (
        PodBinding.objects.filter(
            phase=PodBinding.Phase.RESERVED, deadline__isnull=False, deadline__lte=now
        )
        .order_by("deadline", "id")
        .values_list("pod_uid", "namespace", "name", "node__name", "reserved_at", "deadline")[
            :limit
        ]
    )
    return [ExpiredReservation(*row) for row in rows]


def binding_of(pod_uid: str) -> PodBinding | None:
    """The pod's binding row (any phase), with its node (one query)."""
    return PodBinding.objects.select_related("node").filter(pod_uid=pod_uid).first()


def active_binding_of_pod(namespace: str, name: str) -> PodBinding | None:
    """The active binding of the pod called namespace/name, newest first (one query)."""
    return (
        PodBinding.objects.select_related("node")
        .filter(namespace=namespace, name=name, phase__in=PodBinding.ACTIVE_PHASES)
        .order_by("-reserved_at", "-id")
        .first()
    )


def allocation_of(binding: PodBinding) -> dict[str, Any]:
    """The version-1 allocation record of a binding (docs/allocation.md), one query."""
    # A binding fresh from reserve_binding carries what it wrote; otherwise read the slices.
    rows = getattr(binding, "placed", None) or (
        Slice.objects.filter(binding=binding, active=True)
        .order_by("init_container", "container_index", "id")
        .values_list(
            "container_name",
            "container_index",
            "init_container",
            "card__uuid",
            "card__index",
            "memory_mib",
            "compute_percent",
        )
    )
    containers: dict[tuple[bool, int], tuple[str, list[Device]]] = {}
    for name, index, init, uuid, card_index, memory, cores in rows:
        entry = containers.setdefault((init, index), (name, []))
        entry[1].append(Device(uuid, card_index, memory, cores))
    return allocation_record(
        binding.pod_uid,
        binding.namespace,
        binding.name,
        binding.node.name if binding.node else "",
        (
            ContainerAllocation(name, index, init, tuple(devices))
            for (init, index), (name, devices) in containers.items()
        ),
    )


def binding_cards(binding: PodBinding) -> list[str]:
    """UUIDs of the cards the binding's active slices are on, sorted (one query)."""
    return sorted(
        set(Slice.objects.filter(binding=binding, active=True).values_list("card__uuid", flat=True))
    )


def latest_decision(namespace: str, name: str) -> SchedulingDecision | None:
    """The newest decision recorded for a pod of that name (one query)."""
    return (
        SchedulingDecision.objects.filter(namespace=namespace, name=name)
        .order_by("-decided_at", "-id")
        .first()
    )


@dataclass(frozen=True, slots=True)
class InventoryLimits:
    """The largest things any registered node can hold, for the webhook's sanity checks."""

    max_card_memory_mib: int
    max_cards_per_node: int
    cards: int


def inventory_limits() -> InventoryLimits:
    """Largest card memory and most cards on one node among present cards (two queries)."""
    present = Card.objects.filter(present=True)
    largest = present.aggregate(mem=Max("memory_mib"), n=Count("id"))
    per_node = (
        Node.objects.annotate(n=Count("cards", filter=Q(cards__present=True)))
        .aggregate(most=Max("n"))
        .get("most")
    )
    return InventoryLimits(int(largest["mem"] or 0), int(per_node or 0), int(largest["n"] or 0))
