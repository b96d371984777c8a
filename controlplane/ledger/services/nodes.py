"""Nodes and their cards: a node plugin's inventory report (also its heartbeat), nodes that went
silent or left the cluster, and the slots an operator gives a card."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.ledger.errors import Conflict, NotFound, ServiceError
from controlplane.ledger.models import Card, Node
from controlplane.ledger.services.audit import record_event
from controlplane.ledger.validation import NODE_NAME_HELP, is_node_name

MAX_SLOTS = 64  # slices a card may hold at once: well past what a GPU's memory can be cut into


@dataclass(frozen=True, slots=True)
class CardReport:
    uuid: str
    index: int
    model: str
    memory_mib: int
    numa_node: int | None
    healthy: bool
    health_reason: str


@dataclass(frozen=True, slots=True)
class InventoryReport:
    plugin_version: str
    cards: tuple[CardReport, ...]


@dataclass(frozen=True, slots=True)
class InventoryResult:
    node: Node
    created: bool
    cards_added: tuple[str, ...]
    cards_missing: tuple[str, ...]


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
            )
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
        row.save(
            update_fields=[
                "index", "model", "memory_mib", "numa_node", "healthy", "health_reason",
                "present", "last_seen",
            ]
        )  # fmt: skip

    missing = list(
        Card.objects.filter(node=node, present=True)
        .exclude(uuid__in=reported)
        .values_list("uuid", flat=True)
    )
    if missing:
        Card.objects.filter(node=node, uuid__in=missing).update(present=False)
        for uuid in missing:
            record_event(actor, "card-missing", "card", uuid, node=node.name)
    if created:
        record_event(actor, "node-registered", "node", node.name, cards=len(report.cards))
    elif added:
        record_event(actor, "cards-added", "node", node.name, cards=added)

    node.ready = True
    node.last_heartbeat = now
    node.plugin_version = report.plugin_version
    node.save(update_fields=["ready", "last_heartbeat", "plugin_version"])
    return InventoryResult(node, created, tuple(added), tuple(missing))


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


def lock_card(uuid: str) -> Card:
    """The card's row, locked after its node's (the lock order), with its node; NotFound."""
    card = Card.objects.filter(uuid=uuid).only("id", "node_id").first()
    if card is None:
        raise NotFound(f"card {uuid!r} is not registered with Tessera", field="uuid")
    Node.objects.select_for_update().filter(pk=card.node_id).first()
    return Card.objects.select_for_update(of=("self",)).select_related("node").get(pk=card.pk)


@transaction.atomic(durable=True)
def set_card_slots(uuid: str, slots: int, actor: str) -> Card:
    """How many slices the card may hold at once. Audited when it changes; taking slots away
    below what the card holds now leaves those slices alone and places nothing new there.
    Locks the card's node first, as bind does."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        raise ServiceError(f"slots: give a whole number from 1 to {MAX_SLOTS}", field="slots")
    card = lock_card(uuid)
    if card.slots != slots:
        before, card.slots = card.slots, slots
        card.save(update_fields=["slots"])
        record_event(actor, "card-slots", "card", uuid, node=card.node.name, before=before,
                     after=slots)  # fmt: skip
    return card
