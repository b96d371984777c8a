"""Operators' cordons: a cordoned node or card keeps what it holds and takes nothing new.

Each takes the node's row lock, as bind does, so a bind in flight either sees the cordon or
committed before it. Audited when the flag changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction

from controlplane.ledger.errors import NotFound, ServiceError
from controlplane.ledger.models import Node
from controlplane.ledger.services.audit import record_event
from controlplane.ledger.services.nodes import lock_card
from controlplane.ledger.validation import NODE_NAME_HELP, is_node_name


@dataclass(frozen=True, slots=True)
class Cordon:
    """A node or a card after a cordon or uncordon: `name` is the node's name or the card's
    UUID, `node` the node it is on; `changed` is False when it already was so."""

    kind: str  # "node" or "card"
    name: str
    node: str
    cordoned: bool
    changed: bool


@transaction.atomic(durable=True)
def set_node_cordon(name: str, cordoned: bool, actor: str, reason: str = "") -> Cordon:
    """Cordon (place nothing new) or uncordon a node."""
    if not is_node_name(name):
        raise ServiceError(f"name: {name!r} is not a valid node name: {NODE_NAME_HELP}", "name")
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is None:
        raise NotFound(f"node {name!r} is not registered with Tessera", field="name")
    changed = node.cordoned != cordoned
    if changed:
        node.cordoned = cordoned
        node.save(update_fields=["cordoned"])
        action = "node-cordon" if cordoned else "node-uncordon"
        record_event(actor, action, "node", name, reason=reason[:500])
    return Cordon("node", name, name, cordoned, changed)


@transaction.atomic(durable=True)
def set_card_cordon(uuid: str, cordoned: bool, actor: str, reason: str = "") -> Cordon:
    """Cordon or uncordon one card; locks the card's node first."""
    card = lock_card(uuid)
    changed = card.cordoned != cordoned
    if changed:
        card.cordoned = cordoned
        card.save(update_fields=["cordoned"])
        action = "card-cordon" if cordoned else "card-uncordon"
        record_event(actor, action, "card", uuid, node=card.node.name, reason=reason[:500])
    return Cordon("card", uuid, card.node.name, cordoned, changed)
