"""The dashboard's node pages: nodes with their cards and slices, filtered and paged."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.core.paginator import Page, Paginator
from django.db.models import Q, QuerySet

from controlplane.dashboard.selectors.cards import CardView, card_views
from controlplane.dashboard.selectors.common import PAGE_SIZE
from controlplane.ledger.models import Card, Node, Slice


@dataclass(slots=True)
class NodeView:
    """One node with its cards."""

    id: int
    name: str
    ready: bool
    cordoned: bool
    last_heartbeat: datetime | None
    plugin_version: str
    cards: list[CardView] = field(default_factory=list)

    @property
    def memory_mib(self) -> int:
        return sum(c.memory_mib for c in self.cards if c.present)

    @property
    def memory_allocated_mib(self) -> int:
        return sum(c.usage.memory_mib for c in self.cards if c.present)

    @property
    def unhealthy_cards(self) -> int:
        return sum(1 for c in self.cards if c.state in ("unhealthy", "missing"))


NODE_FIELDS = ("id", "name", "ready", "cordoned", "last_heartbeat", "plugin_version")


def node_views(nodes_qs: QuerySet[Node]) -> list[NodeView]:
    """Nodes (one query) with their cards (one query) and active slices (one query)."""
    nodes = [NodeView(*row) for row in nodes_qs.values_list(*NODE_FIELDS)]
    ids = [n.id for n in nodes]
    by_name = {n.name: n for n in nodes}
    cards = card_views(
        Card.objects.filter(node_id__in=ids).order_by("node_id", "index"),
        Slice.objects.filter(card__node_id__in=ids),
    )
    for card in cards:
        by_name[card.node_name].cards.append(card)
    return nodes


NODE_FILTERS = ("all", "ready", "not-ready", "cordoned", "unhealthy")


def node_queryset(q: str = "", state: str = "all") -> QuerySet[Node]:
    """Nodes by name substring and state (see NODE_FILTERS), ordered by name."""
    nodes = Node.objects.order_by("name")
    if q:
        nodes = nodes.filter(name__icontains=q)
    if state == "ready":
        nodes = nodes.filter(ready=True)
    elif state == "not-ready":
        nodes = nodes.filter(ready=False)
    elif state == "cordoned":
        nodes = nodes.filter(Q(cordoned=True) | Q(cards__cordoned=True)).distinct()
    elif state == "unhealthy":
        nodes = nodes.filter(Q(cards__healthy=False) | Q(cards__present=False)).distinct()
    return nodes


def node_page(
    page: int | str = 1, q: str = "", state: str = "all", per_page: int = PAGE_SIZE
) -> Page:
    """One page of nodes with cards and slices: four queries (count, nodes, cards, slices)."""
    current = Paginator(node_queryset(q, state), per_page).get_page(page)
    current.object_list = node_views(current.object_list)
    return current


def node_detail(name: str) -> NodeView | None:
    """One node with its cards and slices (three queries), or None."""
    nodes = node_views(Node.objects.filter(name=name))
    return nodes[0] if nodes else None
