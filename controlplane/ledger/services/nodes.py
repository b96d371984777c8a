"""Nodes and their cards: a node plugin's inventory report (also its heartbeat), nodes that went
silent or left the cluster, the slots and the oversubscription factor an operator gives a card,
and cards long gone from their node's reports."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Exists, F, OuterRef, Q, QuerySet
from django.utils import timezone

from controlplane.ledger.errors import Conflict, NotFound, ServiceError
from controlplane.ledger.models import Card, Node, PodBinding, Slice
from controlplane.ledger.selectors import card_factor, node_cards
from controlplane.ledger.services.audit import record_event
from controlplane.ledger.services.mode_rules import SYSTEM, initial_mode
from controlplane.ledger.validation import NODE_NAME_HELP, is_node_name
from controlplane.scheduling import (
    FACTOR_ONE,
    FactorError,
    factor_refusal,
    format_factor,
    parse_factor,
)

MAX_SLOTS = 64  # slices a card may hold at once: well past what a GPU's memory can be cut into
# Bounds of a reported MIG layout: NVIDIA's MIG GPUs have at most 8 memory slices and 7 GPU
# instances; twice that leaves room for a larger part without taking a forged list.
MAX_MIG_SLICES = 16
MAX_MIG_INSTANCES = 16


@dataclass(frozen=True, slots=True)
class MigInstanceReport:
    profile: str
    start: int
    size: int
    uuid: str


@dataclass(frozen=True, slots=True)
class MigReport:
    capable: bool
    enabled: bool
    instances: tuple[MigInstanceReport, ...] = ()

    def stored(self) -> list[dict[str, Any]]:
        return [
            {"profile": i.profile, "start": i.start, "size": i.size, "uuid": i.uuid}
            for i in self.instances
        ]


@dataclass(frozen=True, slots=True)
class CardReport:
    uuid: str
    index: int
    model: str
    memory_mib: int
    numa_node: int | None
    healthy: bool
    health_reason: str
    mig: MigReport | None = None  # None: a plugin that predates card modes; keep what is known


@dataclass(frozen=True, slots=True)
class ContainerUsageReport:
    """What one container uses of one card, as the node plugin sampled it."""

    namespace: str
    pod: str
    container: str
    card: str  # the card's UUID
    memory_used_mib: int
    compute_used_percent: int | None  # None: NVML gave no per-process figure
    # From the shim's region (virtual device memory): what the container holds on the card
    # and what it has spilled to host memory; None: the plugin did not say.
    memory_resident_mib: int | None = None
    memory_spilled_mib: int | None = None

    def stored(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("memory_resident_mib", "memory_spilled_mib"):
            if out[key] is None:
                del out[key]  # a sample without them reads as before
        return out


@dataclass(frozen=True, slots=True)
class InventoryReport:
    plugin_version: str
    cards: tuple[CardReport, ...]
    # None: a plugin that sends no usage (older, or metrics sampling off); keep what is known
    usage: tuple[ContainerUsageReport, ...] | None = None
    # Virtual device memory (docs/virtual-memory.md): the node's default factor of its cards
    # (hundredths), the host memory set aside for spill, the node's memory; each None when the
    # plugin does not say (then: 1, 0, unknown).
    memory_factor: int | None = None
    spill_reserve_mib: int | None = None
    host_memory_mib: int | None = None


@dataclass(frozen=True, slots=True)
class InventoryResult:
    node: Node
    created: bool
    cards_added: tuple[str, ...]
    cards_missing: tuple[str, ...]
    cards_pruned: tuple[str, ...] = ()
    modes: Mapping[str, str] = field(default_factory=dict)  # the node's cards: uuid -> mode


@dataclass(frozen=True, slots=True)
class PrunedCard:
    """A card deleted from the ledger, as its audit event records it."""

    uuid: str
    node: str
    model: str
    memory_mib: int
    last_seen: datetime | None
    ended_slices: int  # slices of ended pods that were on it, deleted with it


@transaction.atomic(durable=True)
def apply_inventory(node_name: str, report: InventoryReport, actor: str) -> InventoryResult:
    """Apply a node plugin's report: it is the node's heartbeat and its full list of cards.

    The first report creates the node. Cards missing from a report stay on record (their slices
    too, until the pods end) but take no new slices. A UUID registered to another node is
    refused: a card cannot be in two machines at once, so such a report is wrong or forged.
    """
    if not is_node_name(node_name):
        message = f"name: {node_name!r} is not a valid node name: {NODE_NAME_HELP}"
        raise ServiceError(message, "name")
    _check_spill_reserve(report.spill_reserve_mib, report.host_memory_mib)
    now = timezone.now()
    node, created = Node.objects.get_or_create(name=node_name)
    node = Node.objects.select_for_update().get(pk=node.pk)

    reported = {c.uuid: c for c in report.cards}
    locked_cards = Card.objects.select_for_update(of=("self",)).select_related("node")
    known = {c.uuid: c for c in locked_cards.filter(uuid__in=reported)}
    for position, card in enumerate(report.cards):
        owner = known.get(card.uuid)
        if owner is not None and owner.node_id != node.pk:
            raise Conflict(
                f"card {card.uuid} is registered to node {owner.node.name}; a card cannot be "
                "reported by two nodes. Remove it from that node first if it really moved.",
                field=f"cards[{position}].uuid",
            )

    added: list[str] = []
    for card in report.cards:
        row = known.get(card.uuid)
        if row is None:
            mig = card.mig or MigReport(capable=False, enabled=False)
            start = initial_mode(card.model, mig.capable, settings.TESSERA["CARD_MODE_DEFAULTS"])
            Card.objects.create(
                node=node,
                uuid=card.uuid,
                index=card.index,
                model=card.model,
                memory_mib=card.memory_mib,
                numa_node=card.numa_node,
                healthy=card.healthy,
                health_reason=card.health_reason,
                slots=settings.TESSERA["DEFAULT_SLOTS"],
                present=True,
                last_seen=now,
                mode=start.mode if start else Card.Mode.SHARED,
                mig_capable=mig.capable,
                mig_enabled=mig.enabled,
                mig_instances=mig.stored(),
            )
            if start is not None:
                record_event(
                    SYSTEM, "card-mode", "card", card.uuid, node=node.name, reason=start.note,
                    **{"from": Card.Mode.SHARED.value, "to": start.mode},
                )  # fmt: skip
            added.append(card.uuid)
            continue
        if row.healthy != card.healthy:
            record_event(
                actor, "card-health", "card", card.uuid, healthy=card.healthy,
                reason=card.health_reason,
            )  # fmt: skip
        if not row.present:
            record_event(actor, "card-returned", "card", card.uuid)
        row.index, row.model, row.memory_mib = card.index, card.model, card.memory_mib
        row.numa_node, row.healthy, row.health_reason = (
            card.numa_node,
            card.healthy,
            card.health_reason,
        )
        row.present, row.last_seen = True, now
        fields = [
            "index", "model", "memory_mib", "numa_node", "healthy", "health_reason", "present",
            "last_seen",
        ]  # fmt: skip
        if card.mig is not None:
            row.mig_capable, row.mig_enabled = card.mig.capable, card.mig.enabled
            row.mig_instances = card.mig.stored()
            fields += ["mig_capable", "mig_enabled", "mig_instances"]
        row.save(update_fields=fields)

    missing = list(
        Card.objects.filter(node=node, present=True)
        .exclude(uuid__in=reported)
        .values_list("uuid", flat=True)
    )
    if missing:
        Card.objects.filter(node=node, uuid__in=missing).update(present=False)
        for uuid in missing:
            record_event(actor, "card-missing", "card", uuid, node=node.name)
    # Beyond the per-node allowance of missing cards, the longest missing go now, not only after
    # the retention: a plugin that reports new UUIDs every time would otherwise add up to 64
    # rows per report until the next prune.
    cap = int(settings.TESSERA["MISSING_CARDS_PER_NODE"])
    excess = list(
        _prunable()
        .filter(node=node)
        .order_by(F("last_seen").desc(nulls_last=True), "-id")
        .values_list("id", flat=True)[cap:]
    )
    pruned = _delete_cards(node, excess, actor, f"more than {cap} missing cards on the node")
    if created:
        record_event(actor, "node-registered", "node", node.name, cards=len(report.cards))
    elif added:
        record_event(actor, "cards-added", "node", node.name, cards=added)

    node.ready = True
    node.last_heartbeat = now
    node.plugin_version = report.plugin_version
    fields = ["ready", "last_heartbeat", "plugin_version"]
    # Absent means the defaults: a plugin that never set them reports none, every time.
    memory = (
        FACTOR_ONE if report.memory_factor is None else report.memory_factor,
        report.spill_reserve_mib or 0,
        report.host_memory_mib,
    )
    if memory != (node.memory_factor, node.spill_reserve_mib, node.host_memory_mib):
        if memory[:2] != (node.memory_factor, node.spill_reserve_mib):
            record_event(
                actor, "node-memory", "node", node.name,
                before={"factor": format_factor(node.memory_factor),
                        "spill_reserve_mib": node.spill_reserve_mib},
                after={"factor": format_factor(memory[0]), "spill_reserve_mib": memory[1]},
            )  # fmt: skip
        node.memory_factor, node.spill_reserve_mib, node.host_memory_mib = memory
        fields += ["memory_factor", "spill_reserve_mib", "host_memory_mib"]
    if report.usage is not None:
        node.usage = [u.stored() for u in report.usage]
        node.usage_at = now
        fields += ["usage", "usage_at"]
    node.save(update_fields=fields)
    modes = dict(Card.objects.filter(node=node).values_list("uuid", "mode"))
    return InventoryResult(
        node, created, tuple(added), tuple(missing), tuple(c.uuid for c in pruned), modes
    )


def _check_spill_reserve(reserve_mib: int | None, host_memory_mib: int | None) -> None:
    """A node cannot set aside more host memory for spill than it has: refused, naming both."""
    if reserve_mib is not None and host_memory_mib is not None and reserve_mib > host_memory_mib:
        raise ServiceError(
            f"spill_reserve_mib: {reserve_mib} MiB is more than the node's memory "
            f"(host_memory_mib {host_memory_mib} MiB); set aside at most what the node has",
            "spill_reserve_mib",
        )


def _prunable() -> QuerySet[Card]:
    """Cards gone from their node's reports that nothing holds: no active slice, and no slice of
    a binding that still holds its cards (reserved, bound, allocated)."""
    held = Slice.objects.filter(card=OuterRef("pk")).filter(
        Q(active=True) | Q(binding__phase__in=PodBinding.ACTIVE_PHASES)
    )
    return Card.objects.filter(present=False).exclude(Exists(held))


def _delete_cards(node: Node, card_ids: list[int], actor: str, why: str) -> list[PrunedCard]:
    """Delete these cards of `node` (whose row the caller holds locked), re-checked as prunable
    under that lock, with the slices of ended pods that were on them; one audit event."""
    if not card_ids:
        return []
    cards = list(
        _prunable()
        .select_for_update(of=("self",))
        .filter(node=node, pk__in=card_ids)
        .order_by(F("last_seen").asc(nulls_first=True), "id")
    )
    if not cards:
        return []
    ids = [c.pk for c in cards]
    ended = dict(
        Slice.objects.filter(card_id__in=ids)
        .order_by()
        .values_list("card_id")
        .annotate(n=Count("id"))
        .values_list("card_id", "n")
    )
    Slice.objects.filter(card_id__in=ids).delete()
    Card.objects.filter(pk__in=ids).delete()
    # The node's stamp: the extender's snapshot cache re-reads it and drops the cards.
    Node.objects.filter(pk=node.pk).update()
    pruned = [
        PrunedCard(c.uuid, node.name, c.model, c.memory_mib, c.last_seen, ended.get(c.pk, 0))
        for c in cards
    ]
    record_event(
        actor, "cards-pruned", "node", node.name, reason=why,
        cards=[
            {"uuid": p.uuid, "model": p.model, "memory_mib": p.memory_mib,
             "last_seen": p.last_seen.isoformat() if p.last_seen else None,
             "ended_slices": p.ended_slices}
            for p in pruned
        ],
    )  # fmt: skip
    return pruned


def prune_missing_cards(
    actor: str, *, now: datetime | None = None, limit: int | None = None
) -> tuple[PrunedCard, ...]:
    """Delete cards that have been missing from their node's reports for longer than
    MISSING_CARD_RETENTION_S and that nothing holds (an active slice keeps a card however long
    it has been gone). The slices of ended pods that were on them go too: those bindings stay,
    without that card. At most `limit` (PRUNE_BATCH) cards, longest missing first; one
    transaction per node, under the node's lock, so a report that brings a card back either
    comes first (the card stays) or after (it is registered anew). Audited per node.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.TESSERA["MISSING_CARD_RETENTION_S"])
    limit = limit or int(settings.TESSERA["PRUNE_BATCH"])
    old = _prunable().filter(
        Q(last_seen__lt=cutoff) | Q(last_seen__isnull=True, created_at__lt=cutoff)
    )
    by_node: dict[int, list[int]] = defaultdict(list)
    for node_id, card_id in old.order_by(F("last_seen").asc(nulls_first=True), "id").values_list(
        "node_id", "id"
    )[:limit]:
        by_node[node_id].append(card_id)
    pruned: list[PrunedCard] = []
    for node_id in sorted(by_node):
        pruned += _prune_cards_of(node_id, by_node[node_id], cutoff, actor)
    return tuple(pruned)


@transaction.atomic(durable=True)
def _prune_cards_of(
    node_id: int, card_ids: list[int], cutoff: datetime, actor: str
) -> list[PrunedCard]:
    node = Node.objects.select_for_update().filter(pk=node_id).first()
    if node is None:
        return []
    # Still missing since before the cutoff, under the lock: a report may have come meanwhile.
    still = Card.objects.filter(pk__in=card_ids).filter(
        Q(last_seen__lt=cutoff) | Q(last_seen__isnull=True, created_at__lt=cutoff)
    )
    days = settings.TESSERA["MISSING_CARD_RETENTION_S"] / 86400
    why = f"missing from the node's reports for more than {days:g} day(s)"
    return _delete_cards(node, list(still.values_list("id", flat=True)), actor, why)


@transaction.atomic(durable=True)
def mark_stale_nodes(actor: str, now: datetime | None = None) -> int:
    """Nodes whose plugin has been silent too long are not ready: no new slices land there.

    Their next inventory report makes them ready again. The number marked.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.TESSERA["NODE_STALE_AFTER_S"])
    stale = list(
        Node.objects.select_for_update()
        .filter(ready=True, last_heartbeat__lt=cutoff)
        .values_list("name", flat=True)
    )
    if stale:
        Node.objects.filter(name__in=stale).update(ready=False)
        for name in stale:
            record_event(actor, "node-stale", "node", name, silent_since=str(cutoff))
    return len(stale)


@transaction.atomic(durable=True)
def mark_deleted_nodes(cluster_nodes: set[str], actor: str) -> int:
    """Ledger nodes the API server no longer has are not ready (their bindings end with their
    pods). The number marked."""
    gone = list(
        Node.objects.select_for_update()
        .filter(ready=True)
        .exclude(name__in=cluster_nodes)
        .values_list("name", flat=True)
    )
    if gone:
        Node.objects.filter(name__in=gone).update(ready=False)
        for name in gone:
            record_event(actor, "node-deleted", "node", name)
    return len(gone)


@dataclass(frozen=True, slots=True)
class CardFactor:
    """A card after `set_card_factor`: its own factor before and after (hundredths, None: the
    node's) and the factor that applies."""

    uuid: str
    node: str
    before: int | None
    own: int | None
    applied: int


@transaction.atomic(durable=True)
def set_card_factor(uuid: str, factor: str | None, actor: str, reason: str = "") -> CardFactor:
    """The card's own oversubscription factor (docs/virtual-memory.md): a decimal string from "1"
    to "16" with at most two decimal places, or None to go back to the node's reported default.
    Audited when it changes.

    Locks the card's node first, as bind does, and checks the factor that would apply against
    what the card holds under that lock: one whose virtual budget (f x memory) would no longer
    hold the card's slices is refused (Conflict, naming the figures) and changes nothing. Bound
    slices keep their resident parts whatever the factor (the card's resident sum is the same
    under any factor): it decides the room left."""
    own = None
    if factor is not None:
        try:
            own = parse_factor(factor)
        except FactorError as exc:
            raise ServiceError(f"factor: {exc}", "factor") from None
    card = lock_card(uuid)
    applied = card_factor(own, card.node.memory_factor)
    before = card.memory_factor
    if own != before:
        held = next(c for c in node_cards([card.node.name]) if c.uuid == uuid)
        why = factor_refusal(held.memory_mib, held.used_memory_mib, applied)
        if why is not None:
            raise Conflict(
                f"card {uuid} cannot take oversubscription factor {format_factor(applied)}: {why}",
                field="factor",
            )
        card.memory_factor = own
        card.save(update_fields=["memory_factor"])
        record_event(
            actor, "card-memory-factor", "card", uuid, node=card.node.name, reason=reason,
            before=None if before is None else format_factor(before),
            after=None if own is None else format_factor(own), applies=format_factor(applied),
        )  # fmt: skip
    return CardFactor(uuid, card.node.name, before, own, applied)


def lock_card(uuid: str) -> Card:
    """The card's row, locked after its node's (the lock order), with its node; NotFound."""
    card = Card.objects.filter(uuid=uuid).only("id", "node_id").first()
    if card is None:
        raise NotFound(f"card {uuid!r} is not registered with Tessera", field="uuid")
    Node.objects.select_for_update().filter(pk=card.node_id).first()
    return Card.objects.select_for_update(of=("self",)).select_related("node").get(pk=card.pk)


@dataclass(frozen=True, slots=True)
class CardSlots:
    """A card after `set_card_slots`: the slots it had and the slots it has."""

    uuid: str
    node: str
    before: int
    slots: int


@transaction.atomic(durable=True)
def set_card_slots(uuid: str, slots: int, actor: str) -> CardSlots:
    """How many slices the card may hold at once. Audited when it changes; taking slots away
    below what the card holds now leaves those slices alone and places nothing new there.
    Locks the card's node first, as bind does."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise ServiceError(f"slots: give a whole number from 1 to {MAX_SLOTS}", field="slots")
    card = lock_card(uuid)
    before = card.slots
    if before != slots:
        card.slots = slots
        card.save(update_fields=["slots"])
        record_event(actor, "card-slots", "card", uuid, node=card.node.name, before=before,
                     after=slots)  # fmt: skip
    return CardSlots(uuid, card.node.name, before, slots)
