"""Reads of the ledger, turned into the scheduling core's frozen snapshot.

Each selector runs a fixed number of queries whatever the cluster size (tests lock the count):
the hot paths (filter, bind) must never issue a query per node or per card.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from django.conf import settings
from django.db.models import QuerySet

from controlplane.ledger import sql
from controlplane.ledger.models import Card, NamespaceQuota, Node, PodBinding, Slice
from controlplane.scheduling import (
    CardClaim,
    CardState,
    NodeState,
    QuotaLimits,
    QuotaUsage,
    ResourceNames,
    SchedulingConfig,
    Snapshot,
    card_claims,
    usage_of,
)

MISSING_CARD_REASON = "not in the node's latest inventory report"


def node_names() -> set[str]:
    """Every registered node's name (one query)."""
    return set(Node.objects.values_list("name", flat=True))


def scheduling_config() -> SchedulingConfig:
    """The core's configuration from settings.TESSERA (resource names and defaults)."""
    knobs = settings.TESSERA
    return SchedulingConfig(
        resources=ResourceNames(**knobs["RESOURCES"]),
        default_memory_mib=knobs["DEFAULT_GPUMEM_MIB"],
        default_memory_percent=knobs["DEFAULT_GPUMEM_PERCENTAGE"],
        default_cores=knobs["DEFAULT_GPUCORES"],
        default_node_policy=knobs["DEFAULT_NODE_POLICY"],
        default_gpu_policy=knobs["DEFAULT_GPU_POLICY"],
    )


def _active_slice_rows(slices: QuerySet[Slice]) -> list[sql.SliceRow]:
    rows = slices.filter(active=True).values_list(
        "binding_id",
        "card_id",
        "container_index",
        "init_container",
        "memory_mib",
        "compute_percent",
    )
    return [sql.SliceRow(*row) for row in rows]


def _card_state(card: sql.CardRow | Card, claim: CardClaim | None) -> CardState:
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
    )


def cluster_snapshot(node_names: Iterable[str] | None = None) -> Snapshot:
    """The committed ledger as a core Snapshot, in three queries (hand-written: ledger/sql.py).

    `node_names` limits it to those nodes (unknown names are simply absent); None = all nodes.
    """
    names = None if node_names is None else list(node_names)
    return _build_snapshot(sql.nodes(names), sql.cards(names), sql.active_slices(names))


def node_state(
    node: sql.NodeRow | Node,
    cards: Sequence[sql.CardRow | Card],
    slices: Iterable[sql.SliceRow],
) -> tuple[NodeState, dict[str, int]]:
    """One node as the core sees it, from its committed card and slice rows (bind reads them
    under the node lock), with its cards' ids by UUID (for writing slices)."""
    state = _build_snapshot([node], cards, slices).nodes[0]
    return state, {c.uuid: c.pk for c in cards}


def _build_snapshot(
    nodes: Sequence[sql.NodeRow | Node],
    cards: Sequence[sql.CardRow | Card],
    rows: Iterable[sql.SliceRow],
) -> Snapshot:
    claims = card_claims(rows)
    cards_by_node: dict[int, list[CardState]] = defaultdict(list)
    for card in sorted(cards, key=lambda c: (c.node_id, c.index, c.uuid)):
        cards_by_node[card.node_id].append(_card_state(card, claims.get(card.pk)))
    return Snapshot(
        nodes=tuple(
            NodeState(
                name=node.name,
                ready=node.ready,
                cordoned=node.cordoned,
                cards=tuple(cards_by_node.get(node.pk, ())),
            )
            for node in nodes
        )
    )


def quota_limits(namespace: str) -> QuotaLimits | None:
    """The namespace's limits, or None when it has no quota (unlimited)."""
    quota = NamespaceQuota.objects.filter(namespace=namespace).first()
    return quota_limits_of(quota) if quota else None


def quota_limits_of(quota: NamespaceQuota) -> QuotaLimits:
    return QuotaLimits(memory_mib=quota.gpumem_mib, cores=quota.gpucores, gpus=quota.gpus)


def namespace_usage(namespace: str) -> QuotaUsage:
    """What the namespace's active bindings hold (init-container peaks counted once), one query."""
    rows = _active_slice_rows(
        Slice.objects.filter(
            binding__namespace=namespace, binding__phase__in=PodBinding.ACTIVE_PHASES
        )
    )
    # Summed per card over the pods, each pod's init containers counted at their peak.
    return usage_of(card_claims(rows))
