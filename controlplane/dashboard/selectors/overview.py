"""The overview page and /metrics: cluster totals, fragmentation, pending pods, room held for
preemptions, cards that need attention, and the allocation samples behind the charts."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from controlplane import rawsql
from controlplane.dashboard.models import AllocationSample
from controlplane.dashboard.selectors.common import percent
from controlplane.ledger import usage as ledger_usage
from controlplane.ledger.models import Card, Node, Nomination, PodBinding, SchedulingDecision, Slice

ACTIVE_PHASES = tuple(str(p) for p in PodBinding.ACTIVE_PHASES)


def slice_sizes() -> Counter[int]:
    """How many active slices there are of each memory size (one query)."""
    rows = (
        Slice.objects.filter(active=True)
        .order_by()
        .values_list("memory_mib")
        .annotate(n=Count("id"))
    )
    return Counter(dict(rawsql.rows_of(rows)))


@dataclass(frozen=True, slots=True)
class Fragmentation:
    """Free memory on schedulable cards that slices of the most common size cannot use.

    For each schedulable card (healthy, present, not cordoned, on a ready uncordoned node) with
    free memory F, free slots N and size S = the most common memory request among active slices:
    usable = S * min(F // S, N), or 0 when the card is held exclusively; stranded = F - usable.
    `percent` = stranded / free over all such cards. No active slices means no common size and
    nothing counted as stranded.
    """

    common_request_mib: int | None
    free_mib: int
    stranded_mib: int

    @property
    def percent(self) -> float:
        return 100.0 * self.stranded_mib / self.free_mib if self.free_mib else 0.0


@dataclass(frozen=True, slots=True)
class Overview:
    """Cluster totals for the overview page, the samples and /metrics."""

    nodes: int
    nodes_ready: int
    nodes_cordoned: int
    cards: int
    cards_unhealthy: int
    cards_cordoned: int
    cards_missing: int
    memory_total_mib: int
    memory_allocated_mib: int
    compute_total: int
    compute_allocated: int
    slots_total: int
    slots_allocated: int
    slices: int
    pending_reserved: int
    pending_unschedulable: int
    fragmentation: Fragmentation

    @property
    def pending_pods(self) -> int:
        return self.pending_reserved + self.pending_unschedulable

    @property
    def memory_percent(self) -> float:
        return percent(self.memory_allocated_mib, self.memory_total_mib)

    @property
    def compute_percent(self) -> float:
        return percent(self.compute_allocated, self.compute_total)

    @property
    def slots_percent(self) -> float:
        return percent(self.slots_allocated, self.slots_total)


def common_request_size(counts: Counter[int]) -> int | None:
    """The most common slice memory size; ties go to the smaller size (the stricter test)."""
    if not counts:
        return None
    return min(counts.items(), key=lambda item: (-item[1], item[0]))[0]


def stranded_memory(free_mib: int, free_slots: int, exclusive: bool, size: int | None) -> int:
    """Free MiB of one schedulable card that slices of `size` MiB cannot use (see Fragmentation)."""
    if size is None or free_mib <= 0:
        return 0
    if exclusive or free_slots <= 0:
        return free_mib
    return free_mib - size * min(free_mib // size, free_slots)


def pending_counts() -> tuple[int, int]:
    """(reserved bindings, pods whose latest decision is unschedulable and hold nothing). 2 queries.

    A reservation waits for the API server's Binding; an unschedulable pod waits for room.
    """
    reserved = PodBinding.objects.filter(phase=PodBinding.Phase.RESERVED).count()
    unschedulable = _unschedulable_decisions().count()
    return reserved, unschedulable


def _unschedulable_decisions() -> QuerySet[SchedulingDecision]:
    """Latest decisions that found no room, of pods that hold no active binding."""
    holds = PodBinding.objects.filter(pod_uid=OuterRef("pod_uid"), phase__in=ACTIVE_PHASES)
    return SchedulingDecision.objects.filter(
        outcome=SchedulingDecision.Outcome.UNSCHEDULABLE
    ).exclude(Exists(holds))


def cluster_overview() -> Overview:
    """Totals of the whole cluster in seven queries, none of which reads every slice row."""
    node_stats = Node.objects.aggregate(
        total=Count("id"),
        ready=Count("id", filter=Q(ready=True)),
        cordoned=Count("id", filter=Q(cordoned=True)),
    )
    cards = rawsql.rows_of(
        Card.objects.order_by().values_list(
            "id",
            "memory_mib",
            "compute_units",
            "slots",
            "healthy",
            "present",
            "cordoned",
            "node__ready",
            "node__cordoned",
        )
    )
    held = ledger_usage.card_usage()
    sizes = slice_sizes()
    common = common_request_size(sizes)
    counts: dict[str, int] = defaultdict(int)
    free_total = stranded_total = 0
    for card_id, memory, compute, slots, healthy, present, cordoned, ready, node_cordoned in cards:
        if not present:
            counts["missing"] += 1
            continue
        used = held.get(card_id, ledger_usage.EMPTY_CARD)
        counts["cards"] += 1
        counts["unhealthy"] += not healthy
        counts["cordoned"] += cordoned
        counts["memory"] += memory
        counts["memory_used"] += used.memory_mib
        counts["compute"] += compute
        counts["compute_used"] += used.cores
        counts["slots"] += slots
        counts["slots_used"] += used.slots
        if healthy and not cordoned and ready and not node_cordoned:
            free = max(memory - used.memory_mib, 0)
            free_total += free
            stranded_total += stranded_memory(free, slots - used.slots, used.exclusive, common)
    reserved, unschedulable = pending_counts()
    return Overview(
        nodes=node_stats["total"],
        nodes_ready=node_stats["ready"],
        nodes_cordoned=node_stats["cordoned"],
        cards=counts["cards"],
        cards_unhealthy=counts["unhealthy"],
        cards_cordoned=counts["cordoned"],
        cards_missing=counts["missing"],
        memory_total_mib=counts["memory"],
        memory_allocated_mib=counts["memory_used"],
        compute_total=counts["compute"],
        compute_allocated=counts["compute_used"],
        slots_total=counts["slots"],
        slots_allocated=counts["slots_used"],
        slices=sum(sizes.values()),
        pending_reserved=reserved,
        pending_unschedulable=unschedulable,
        fragmentation=Fragmentation(common, free_total, stranded_total),
    )


@dataclass(frozen=True, slots=True)
class PendingPod:
    """A pod waiting for GPUs: reserved (waiting for its Binding) or unschedulable."""

    namespace: str
    name: str
    kind: str  # "reserved" | "unschedulable"
    detail: str
    since: datetime | None


def pending_pods(limit: int = 10) -> list[PendingPod]:
    """The newest pending pods of each kind, at most `limit` of each (two queries)."""
    reserved = [
        PendingPod(ns, name, "reserved", f"room reserved on {node}", at)
        for ns, name, node, at in PodBinding.objects.filter(phase=PodBinding.Phase.RESERVED)
        .order_by("-reserved_at", "-id")
        .values_list("namespace", "name", "node__name", "reserved_at")[:limit]
    ]
    waiting = [
        PendingPod(ns, name, "unschedulable", summary, at)
        for ns, name, summary, at in _unschedulable_decisions()
        .order_by("-decided_at", "-id")
        .values_list("namespace", "name", "summary", "decided_at")[:limit]
    ]
    return reserved + waiting


@dataclass(frozen=True, slots=True)
class RoomHold:
    """Room held on a node for a pod whose preemption is under way (docs/preemption.md)."""

    namespace: str
    name: str
    node: str
    priority: int
    cards: int
    memory_mib: int
    victims: list[str]
    until: datetime


def room_holds(node: str = "", limit: int = 50) -> list[RoomHold]:
    """Unexpired nominations (of `node`), the soonest to end first (one query)."""
    rows = Nomination.objects.filter(deadline__gt=timezone.now())
    if node:
        rows = rows.filter(node__name=node)
    return [
        RoomHold(ns, name, node_name, priority, len(claims),
                 sum(int(c[0]) for c in claims.values()), list(victims), until)
        for ns, name, node_name, priority, claims, victims, until in rows.order_by(
            "deadline", "id"
        ).values_list(
            "namespace", "name", "node__name", "priority", "claims", "victims", "deadline"
        )[:limit]
    ]  # fmt: skip


def attention_cards(limit: int = 20) -> list[dict[str, Any]]:
    """Cards that are unhealthy, missing from their node's report or cordoned (one query)."""
    return list(
        Card.objects.filter(Q(healthy=False) | Q(present=False) | Q(cordoned=True))
        .order_by("node__name", "index")
        .values(
            "uuid",
            "index",
            "model",
            "node__name",
            "healthy",
            "health_reason",
            "present",
            "cordoned",
        )[:limit]
    )


def allocation_samples(hours: int = 6, now: datetime | None = None) -> list[AllocationSample]:
    """Samples of the last `hours`, oldest first (one query)."""
    since = (now or timezone.now()) - timedelta(hours=hours)
    return list(AllocationSample.objects.filter(bucket__gte=since).order_by("bucket"))
