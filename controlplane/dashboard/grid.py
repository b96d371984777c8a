"""The card grid (`/grid/`): every card of the cluster on one screen, one cell each.

Built for 1,000 nodes x 8 cards with tens of thousands of slices: four queries whatever the size
(cards with their node's flags; per-card usage, two, from the ledger's one usage arithmetic; the
pods on each card), filters and sort folded in Python over those rows, and the cells written by
`render_cells` as one string with short CSS classes (a template loop over 8,000 cells, or an
inline style per cell, would cost more time and bytes than everything else on the page).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from html import escape
from urllib.parse import quote

from django.urls import reverse
from django.utils.safestring import SafeString, mark_safe

from controlplane import rawsql
from controlplane.ledger import usage as ledger_usage
from controlplane.ledger.models import Card, PodBinding, Slice

STATES = ("healthy", "unhealthy", "cordoned", "draining")
COLOURS = ("memory", "compute")
SORTS = ("node", "free", "-free")
# Pods named in a cell's tooltip; a card holds at most its slots' worth, so this rarely cuts.
TOOLTIP_PODS = 12
# The CSS class of each mode other than the usual one: a letter in the corner of the cell.
MODE_MARK = {"mig": " mM", "mps": " mP", "exclusive": " mX"}
ACTIVE_PHASES = tuple(str(p) for p in PodBinding.ACTIVE_PHASES)


@dataclass(frozen=True, slots=True)
class GridFilters:
    """What the grid shows: empty strings mean "any"."""

    model: str = ""
    namespace: str = ""
    state: str = ""
    colour: str = "memory"
    sort: str = "node"


@dataclass(frozen=True, slots=True)
class GridCard:
    """One cell: a card's identity, flags and what its slices hold."""

    uuid: str
    index: int
    model: str
    node: str
    memory_mib: int
    compute_units: int
    slots: int
    mode: str
    pending_mode: str
    healthy: bool
    present: bool
    cordoned: bool
    node_cordoned: bool
    node_ready: bool
    used_memory_mib: int
    used_cores: int
    used_slots: int
    pods: tuple[str, ...]

    @property
    def free_memory_mib(self) -> int:
        return max(self.memory_mib - self.used_memory_mib, 0)

    @property
    def states(self) -> frozenset[str]:
        """Every filter state the card matches: a card can be cordoned and draining at once."""
        found = set()
        if not self.healthy or not self.present:
            found.add("unhealthy")
        if self.cordoned or self.node_cordoned:
            found.add("cordoned")
        if self.pending_mode:
            found.add("draining")
        return frozenset(found or {"healthy"})

    @property
    def state(self) -> str:
        """The one state the cell is marked with, worst first."""
        states = self.states
        return next(s for s in ("unhealthy", "draining", "cordoned", "healthy") if s in states)

    def share(self, colour: str) -> float:
        """Allocated share (0-1) of memory or compute, by the grid's colour toggle."""
        if colour == "compute":
            return self.used_cores / self.compute_units if self.compute_units else 0.0
        return self.used_memory_mib / self.memory_mib if self.memory_mib else 0.0


@dataclass(slots=True)
class GridNode:
    """A node's group of cells."""

    name: str
    ready: bool
    cordoned: bool
    cards: list[GridCard] = field(default_factory=list)

    @property
    def free_memory_mib(self) -> int:
        return sum(c.free_memory_mib for c in self.cards)


@dataclass(frozen=True, slots=True)
class Grid:
    """The page's data: the node groups shown, and the choices of the filters."""

    nodes: list[GridNode]
    cards_shown: int
    cards_total: int
    models: list[str]
    namespaces: list[str]


CARD_ROW = (
    "id", "uuid", "index", "model", "node__name", "memory_mib", "compute_units", "slots", "mode",
    "pending_mode", "healthy", "present", "cordoned", "node__cordoned", "node__ready",
)  # fmt: skip


def pods_per_card() -> dict[int, list[str]]:
    """Per card id, the `namespace/name` of each pod with an active slice there, sorted (one
    query)."""
    rows = rawsql.rows_of(
        Slice.objects.filter(active=True, binding__phase__in=ACTIVE_PHASES)
        .order_by()
        .values_list("card_id", "binding__namespace", "binding__name")
        .distinct()
    )
    pods: dict[int, list[str]] = defaultdict(list)
    for card_id, namespace, name in rows:
        pods[card_id].append(f"{namespace}/{name}")
    for names in pods.values():
        names.sort()
    return pods


def card_grid(filters: GridFilters) -> Grid:
    """The grid's cells, filtered and sorted, grouped by node (four queries)."""
    rows = rawsql.rows_of(Card.objects.order_by("node__name", "index").values_list(*CARD_ROW))
    held = ledger_usage.card_usage()
    pods = pods_per_card()
    models: set[str] = set()
    namespaces: set[str] = set()
    groups: dict[str, GridNode] = {}
    shown = 0
    for (card_id, uuid, index, model, node, memory, compute, slots, mode, pending, healthy,
         present, cordoned, node_cordoned, ready) in rows:  # fmt: skip
        models.add(model)
        on_card = pods.get(card_id, [])
        card_namespaces = {p.split("/", 1)[0] for p in on_card}
        namespaces |= card_namespaces
        group = groups.get(node)
        if group is None:
            group = groups[node] = GridNode(node, ready, node_cordoned)
        if filters.model and model != filters.model:
            continue
        if filters.namespace and filters.namespace not in card_namespaces:
            continue
        used = held.get(card_id, ledger_usage.EMPTY_CARD)
        card = GridCard(
            uuid, index, model, node, memory, compute, slots, mode, pending, healthy, present,
            cordoned, node_cordoned, ready, used.memory_mib, used.cores, used.slots,
            tuple(on_card),
        )  # fmt: skip
        if filters.state and filters.state not in card.states:
            continue
        group.cards.append(card)
        shown += 1
    nodes = [g for g in groups.values() if g.cards]
    if filters.sort in ("free", "-free"):
        most_first = filters.sort == "free"
        for g in nodes:
            g.cards.sort(key=lambda c: -c.free_memory_mib if most_first else c.free_memory_mib)
        nodes.sort(key=lambda g: (-g.free_memory_mib if most_first else g.free_memory_mib, g.name))
    return Grid(nodes, shown, len(rows), sorted(models), sorted(namespaces))


def _level(share: float) -> int:
    """The colour step of an allocated share: 0 (none) to 10 (full), in tenths rounded up, so a
    card with anything allocated is never drawn as empty."""
    if share <= 0:
        return 0
    return min(10, max(1, int(share * 10 + 0.999)))


def _tooltip(card: GridCard) -> str:
    pods = card.pods[:TOOLTIP_PODS]
    more = len(card.pods) - len(pods)
    pod_line = ", ".join(pods) + (f" and {more} more" if more else "") if pods else "no pods"
    mode = card.mode + (f" \u2192 {card.pending_mode} (draining)" if card.pending_mode else "")
    return (
        f"GPU {card.index} \u00b7 {card.node} \u00b7 {card.state}\n{card.model} \u00b7 {mode}\n"
        f"memory {card.used_memory_mib}/{card.memory_mib} MiB \u00b7 "
        f"compute {card.used_cores}/{card.compute_units}% \u00b7 "
        f"slots {card.used_slots}/{card.slots}\n{pod_line}"
    )


def render_cells(nodes: Iterable[GridNode], colour: str) -> SafeString:
    """The grid's HTML: per node a labelled group, per card a linked cell whose class carries
    its colour step (`aN`), its state (`sU` unhealthy, `sD` draining, `sC` cordoned) and its
    mode's mark; the title says the rest. Every ledger value is escaped."""
    card_prefix = reverse("dashboard:card", args=["x"])[: -len("x/")]
    node_prefix = reverse("dashboard:node", args=["x"])[: -len("x/")]
    state_mark = {"healthy": "", "unhealthy": " sU", "draining": " sD", "cordoned": " sC"}
    out: list[str] = []
    for group in nodes:
        name = escape(group.name)
        flag = "" if group.ready else " nr"
        out.append(
            f'<div class="gn{flag}"><a class="gl" href="{node_prefix}{quote(group.name)}/">'
            f"{name}</a>"
        )
        for c in group.cards:
            css = f"c a{_level(c.share(colour))}{state_mark[c.state]}{MODE_MARK.get(c.mode, '')}"
            out.append(
                f'<a class="{css}" href="{card_prefix}{quote(c.uuid, safe="")}/" '
                f'title="{escape(_tooltip(c))}"></a>'
            )
        out.append("</div>")
    return mark_safe("".join(out))  # noqa: S308 - every ledger value above is escaped
