"""Reads of the ledger that other layers use, in a fixed number of queries each.

The hot paths (filter, bind) never issue a query per node or per card (tests lock the counts):
the cluster snapshot is three hand-written queries (ledger/sql.py), a node read under bind's
lock one round trip. Usage arithmetic is `controlplane.ledger.usage`, the "why is my pod
pending?" answer `controlplane.ledger.why`, the allocation record `controlplane.ledger.allocation`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db.models import Count, Max, Q

from controlplane.ledger import allocation, sql, usage
from controlplane.ledger.models import (
    Card,
    NamespaceQuota,
    Node,
    PodBinding,
    SchedulingDecision,
    Slice,
)
from controlplane.scheduling import (
    FACTOR_ONE,
    CardClaim,
    CardState,
    NodeState,
    QuotaLimits,
    ResourceNames,
    SchedulingConfig,
    Snapshot,
    virtual_mib,
)
from controlplane.scheduling.mig import placement_mask

MISSING_CARD_REASON = "not in the node's latest inventory report"


def scheduling_config() -> SchedulingConfig:
    """The core's configuration from settings.TESSERA (resource names and defaults)."""
    knobs = settings.TESSERA
    modes = knobs["DEFAULT_VGPU_MODES"]
    return SchedulingConfig(
        resources=ResourceNames(**knobs["RESOURCES"]),
        default_memory_mib=knobs["DEFAULT_GPUMEM_MIB"],
        default_memory_percent=knobs["DEFAULT_GPUMEM_PERCENTAGE"],
        default_cores=knobs["DEFAULT_GPUCORES"],
        default_node_policy=knobs["DEFAULT_NODE_POLICY"],
        default_gpu_policy=knobs["DEFAULT_GPU_POLICY"],
        # "hami-core" alone is the core's own default: a request then stores no modes.
        default_vgpu_modes=() if modes == ("hami-core",) else modes,
        mig_resources=knobs["MIG_RESOURCES"],
    )


# --- the cluster as the scheduling core sees it --------------------------------------------------


def _card_state(
    card: sql.CardRow, claim: CardClaim | None, mig_used: int, node_factor: int
) -> CardState:
    healthy = card.healthy and card.present
    reason = card.health_reason if card.present else MISSING_CARD_REASON
    return CardState(
        uuid=card.uuid,
        index=card.index,
        model=card.model,
        memory_mib=card.memory_mib,
        compute_units=card.compute_units,
        slots=card.slots,
        numa_node=card.numa_node,
        healthy=healthy,
        health_reason=reason,
        cordoned=card.cordoned,
        used_memory_mib=claim.memory_mib if claim else 0,
        used_compute=claim.cores if claim else 0,
        used_slots=claim.slots if claim else 0,
        exclusive=claim.exclusive if claim else False,
        mode=card.mode,
        draining=bool(card.pending_mode),
        mig_enabled=card.mig_enabled,
        mig_used=mig_used,
        factor=card_factor(card.memory_factor, node_factor),
        used_resident_mib=claim.resident_mib if claim else None,
    )


def card_factor(own: int | None, node_default: int) -> int:
    """A card's oversubscription factor (hundredths): the operator's own, else the node's
    reported default (docs/virtual-memory.md)."""
    return node_default if own is None else own


def cluster_snapshot(node_names: Iterable[str] | None = None, *, for_pod: str = "") -> Snapshot:
    """The committed ledger as a core Snapshot, in four queries (hand-written: ledger/sql.py).

    `node_names` limits it to those nodes (unknown names are simply absent); None = all nodes.
    Room held by nominations counts as taken, except the one of pod UID `for_pod`.
    """
    names = None if node_names is None else list(node_names)
    snapshot = _build_snapshot(sql.nodes(names), sql.cards(names), sql.active_slices(names))
    return with_holds(snapshot, sql.held(names), for_pod)


def held_claims(value: Any) -> dict[str, CardClaim]:
    """A nomination's claims JSON (card UUID -> [memory, compute, slots, exclusive, MIG
    mask] and, for a pod whose slices spill there, [resident, spill]; holds written before
    MIG placements had four)."""
    if isinstance(value, str | bytes):
        value = json.loads(value)
    return {
        str(uuid): CardClaim(
            int(c[0]),
            int(c[1]),
            int(c[2]),
            bool(c[3]),
            int(c[4]) if len(c) > 4 else 0,
            int(c[5]) if len(c) > 5 else None,
            int(c[6]) if len(c) > 6 else 0,
        )
        for uuid, c in value.items()
    }


def holding(state: NodeState, held: Iterable[tuple[str, Any]], for_pod: str = "") -> NodeState:
    """The node with the room nominations hold on it taken, except `for_pod`'s own."""
    for uid, claims in held:
        if uid != for_pod:
            state = state.with_claims(held_claims(claims))
    return state


def with_holds(
    snapshot: Snapshot, held: Iterable[tuple[str, str, Any]], for_pod: str = ""
) -> Snapshot:
    """The snapshot with the nominations' room taken (`holding`) on their nodes."""
    per_node: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for node, uid, claims in held:
        if uid != for_pod and node in snapshot.by_name:
            per_node[node].append((uid, claims))
    if not per_node:
        return snapshot
    return snapshot.replacing(
        {name: holding(snapshot.by_name[name], rows) for name, rows in per_node.items()}
    )


def node_cards(node_names: Iterable[str]) -> list[CardState]:
    """The named nodes' cards as the core sees them (three queries)."""
    return [card for node in cluster_snapshot(node_names).nodes for card in node.cards]


def node_state(
    node: sql.NodeRow, cards: Sequence[sql.CardRow], slices: Iterable[sql.SliceRow]
) -> tuple[NodeState, dict[str, int]]:
    """One node as the core sees it, from its committed card and slice rows (bind reads them
    under the node lock), with its cards' ids by UUID (for writing slices)."""
    state = _build_snapshot([node], cards, slices).nodes[0]
    return state, {c.uuid: c.pk for c in cards}


def _build_snapshot(
    nodes: Sequence[sql.NodeRow], cards: Sequence[sql.CardRow], rows: Iterable[sql.SliceRow]
) -> Snapshot:
    rows = rows if isinstance(rows, list) else list(rows)
    claims = usage.claims_of(rows)
    # The memory slices each MIG card's instances cover: what a new instance must avoid.
    mig_used: dict[int, int] = {}
    for row in rows:
        if row.mig_size:
            mask = placement_mask(row.mig_start or 0, row.mig_size)
            mig_used[row.card_id] = mig_used.get(row.card_id, 0) | mask
    factors = {node.pk: node.memory_factor for node in nodes}
    cards_by_node: dict[int, list[CardState]] = defaultdict(list)
    spill: dict[int, int] = defaultdict(int)
    for card in sorted(cards, key=lambda c: (c.node_id, c.index, c.uuid)):
        claim = claims.get(card.pk)
        if claim is not None and claim.spill_mib:
            spill[card.node_id] += claim.spill_mib
        cards_by_node[card.node_id].append(
            _card_state(card, claim, mig_used.get(card.pk, 0), factors.get(card.node_id, 100))
        )
    return Snapshot(
        nodes=tuple(
            NodeState(
                name=node.name,
                ready=node.ready,
                cordoned=node.cordoned,
                cards=tuple(cards_by_node.get(node.pk, ())),
                spill_reserve_mib=node.spill_reserve_mib,
                used_spill_mib=spill.get(node.pk, 0),
            )
            for node in nodes
        )
    )


def changes_since(since: datetime) -> list[tuple[str, str | None, str | None]]:
    """What changed at or after `since` (one query): (node, pod UID, phase) per binding row,
    (node, None, None) per node or card row. Every write of those rows moves `updated_at`
    (`models.Stamped`); a binding's slices change only with the binding row (reserve, release),
    so its stamp covers them."""
    return sql.changes_since(since)


def ledger_counts() -> tuple[int, int]:
    """(nodes, cards) in the ledger: deletions are the one change a stamp cannot show."""
    return sql.ledger_counts()


def node_names() -> set[str]:
    """Every registered node's name (one query)."""
    return set(Node.objects.values_list("name", flat=True))


# --- quotas --------------------------------------------------------------------------------------


def quota_limits(namespace: str) -> QuotaLimits | None:
    """The namespace's limits, or None when it has no quota (unlimited)."""
    quota = NamespaceQuota.objects.filter(namespace=namespace).first()
    return QuotaLimits(quota.gpumem_mib, quota.gpucores, quota.gpus) if quota else None


def all_quota_limits() -> dict[str, QuotaLimits]:
    """Every namespace quota (one query)."""
    return sql.quota_limits()


# --- bindings ------------------------------------------------------------------------------------


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
    else will ever confirm or release it. The reconciler asks the API server whether the pod
    was bound (then confirms it) or not (then fails it).
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


@dataclass(frozen=True, slots=True)
class PodAllocation:
    """What the pod called namespace/name holds now: its active binding's node and allocation
    record (docs/allocation.md)."""

    node: str
    record: dict[str, Any]


def active_allocation_of_pod(namespace: str, name: str) -> PodAllocation | None:
    """The allocation of the pod's active binding (the newest), None when it has none; two
    queries. Without a pod of that name, a ResourceClaim's (DRA mode: the claim's record, read
    by the same API): a pod and a claim may share a name, and the node plugin asks for pods."""
    binding = (
        PodBinding.objects.select_related("node")
        .filter(namespace=namespace, name=name, phase__in=PodBinding.ACTIVE_PHASES)
        # "pod" after "claim": a pod's row first
        .order_by("-source", "-reserved_at", "-id")
        .first()
    )
    if binding is None:
        return None
    return PodAllocation(binding.node.name if binding.node else "", allocation_of(binding))


def allocation_of(binding: PodBinding) -> dict[str, Any]:
    """The version-1 allocation record of a binding (docs/allocation.md), one query."""
    rows = (
        Slice.objects.filter(binding=binding, active=True)
        .order_by("init_container", "container_index", "id")
        .values_list(*allocation.SLICE_COLUMNS)
    )
    return allocation.allocation_record(
        binding.pod_uid,
        binding.namespace,
        binding.name,
        binding.node.name if binding.node else "",
        allocation.containers_of(map(allocation.SliceRow._make, rows)),
    )


def uids_with_bindings(pod_uids: Sequence[str]) -> set[str]:
    """Those of `pod_uids` the ledger has a binding for, of any phase (a query per 5,000)."""
    found: set[str] = set()
    for start in range(0, len(pod_uids), 5000):  # bounded IN lists (SQLite caps parameters)
        chunk = pod_uids[start : start + 5000]
        found.update(PodBinding.objects.filter(pod_uid__in=chunk).values_list("pod_uid", flat=True))
    return found


def decided_pod_uids(before: datetime) -> set[str]:
    """The pods with a decision log entry decided before `before` (one query; the log is
    bounded by its retention), for the reconciler to find those the cluster no longer has."""
    return set(
        SchedulingDecision.objects.filter(decided_at__lt=before).values_list("pod_uid", flat=True)
    )


# --- inventory -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InventoryLimits:
    """The largest things any registered node can hold, for the webhook's sanity checks.
    ``max_oversubscribed_mib``: the most an opted-in slice could ever take on one card
    (docs/virtual-memory.md), 0 where no card oversubscribes."""

    max_card_memory_mib: int
    max_cards_per_node: int
    cards: int
    max_oversubscribed_mib: int = 0


def inventory_limits() -> InventoryLimits:
    """Largest card memory and most cards on one node among present cards, and the largest
    slice an opted-in pod could get on an oversubscribing card (three queries)."""
    present = Card.objects.filter(present=True)
    largest = present.aggregate(mem=Max("memory_mib"), n=Count("id"))
    per_node = (
        Node.objects.annotate(n=Count("cards", filter=Q(cards__present=True)))
        .aggregate(most=Max("n"))
        .get("most")
    )
    # An opted-in slice of m MiB on an empty card of M MiB at factor f: m <= f x M, and what it
    # spills, m - ceil(m / f), within the node's reserve R; so m <= M + R as well. Only shared
    # cards on nodes with a reserve can take one past the card.
    spilling = present.filter(mode=Card.Mode.SHARED, node__spill_reserve_mib__gt=0).values_list(
        "memory_mib", "memory_factor", "node__memory_factor", "node__spill_reserve_mib"
    )
    oversubscribed = max(
        (
            min(virtual_mib(memory, factor), memory + reserve)
            for memory, own, node_default, reserve in spilling
            if (factor := card_factor(own, node_default)) > FACTOR_ONE
        ),
        default=0,
    )
    return InventoryLimits(
        int(largest["mem"] or 0), int(per_node or 0), int(largest["n"] or 0), oversubscribed
    )


def shared_card_sizes() -> tuple[int, ...]:
    """The distinct memory sizes (MiB) of present cards in shared or MPS mode, ascending: what
    DRA mode's webhook turns a memory percentage into (docs/dra.md, *HAMi pods in DRA mode*)."""
    sizes = (
        Card.objects.filter(present=True, mode__in=(Card.Mode.SHARED, Card.Mode.MPS))
        .values_list("memory_mib", flat=True)
        .distinct()
    )
    return tuple(sorted(set(sizes)))


def snapshot_of(
    nodes: Sequence[sql.NodeRow], cards: Sequence[sql.CardRow], rows: Iterable[sql.SliceRow]
) -> Snapshot:
    """The snapshot of rows a caller read itself (preemption reads the slices for its own use
    too, so that the node and the pods on it come from one read)."""
    return _build_snapshot(nodes, cards, rows)


# The columns of a claim's slice, in the order of `services.claims.ClaimSlice`'s fields.
MIRRORED_SLICE_COLUMNS = (
    "card__uuid", "container_name", "container_index", "memory_mib", "compute_percent",
    "mig_profile", "mig_start", "mig_size",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class MirroredClaim:
    """A claim's active row in the ledger: where, since when, and its slices as tuples of
    `MIRRORED_SLICE_COLUMNS`."""

    uid: str
    node: str
    created_at: datetime
    slices: frozenset[tuple[Any, ...]]


def mirrored_claims(uids: Sequence[str] | None = None) -> dict[str, MirroredClaim]:
    """The active rows of claims (all, or those of `uids`) by claim UID, with their active
    slices: two queries (per 5,000 UIDs)."""
    chunks = [None] if uids is None else [uids[i : i + 5000] for i in range(0, len(uids), 5000)]
    found: dict[str, MirroredClaim] = {}
    for chunk in chunks:
        rows = PodBinding.objects.filter(
            source=PodBinding.Source.CLAIM, phase__in=PodBinding.ACTIVE_PHASES
        )
        if chunk is not None:
            rows = rows.filter(pod_uid__in=list(chunk))
        heads = {
            pk: (uid, node or "", created)
            for pk, uid, node, created in rows.values_list(
                "pk", "pod_uid", "node__name", "created_at"
            )
        }
        held = Slice.objects.filter(active=True)
        if chunk is None:  # every claim: a join, not an IN list of every row's id
            held = held.filter(
                binding__source=PodBinding.Source.CLAIM,
                binding__phase__in=PodBinding.ACTIVE_PHASES,
            )
        else:
            held = held.filter(binding_id__in=list(heads))
        slices: dict[int, set[tuple[Any, ...]]] = defaultdict(set)
        for binding_id, *row in held.values_list("binding_id", *MIRRORED_SLICE_COLUMNS):
            slices[binding_id].add(tuple(row))
        for pk, (uid, node, created) in heads.items():
            found[uid] = MirroredClaim(uid, node, created, frozenset(slices[pk]))
    return found
