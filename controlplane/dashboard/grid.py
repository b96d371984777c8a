"""The card grid (`/grid/`): every card of the cluster on one screen, one cell each.

Built for 1,000 nodes x 8 cards with tens of thousands of slices: four queries whatever the size
(cards with their node's flags; per-card usage, two, from the ledger's one usage arithmetic; the
pods on each card), filters and sort folded in Python over those rows, and the cells written by
`render_cells` as one string with short CSS classes (a template loop over 8,000 cells, or an
inline style per cell, would cost more time and bytes than everything else on the page).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from html import escape
from typing import NamedTuple
from urllib.parse import quote

from django.urls import reverse
from django.utils.safestring import SafeString, mark_safe

from controlplane import rawsql
from controlplane.ledger import usage as ledger_usage
from controlplane.ledger.models import Card, PodBinding, Slice
from controlplane.ledger.selectors import card_factor
from controlplane.scheduling import FACTOR_ONE, format_factor, virtual_mib

STATES = ("healthy", "unhealthy", "cordoned", "draining")
COLOURS = ("memory", "compute")
SORTS = ("node", "free", "-free")
# Pods named in a cell's tooltip; a card holds at most its slots' worth, so this rarely cuts.
TOOLTIP_PODS = 12
# The CSS class of each mode other than the usual one: a letter in the corner of the cell.
MODE_MARK = {"mig": " mM", "mps": " mP", "exclusive": " mX"}


@dataclass(frozen=True, slots=True)
class GridFilters:
    """What the grid shows: empty strings mean "any"."""

    model: str = ""
    namespace: str = ""
    state: str = ""
    colour: str = "memory"
    sort: str = "node"


class GridCard(NamedTuple):
    """One cell: a card's identity, flags and what its slices hold. A tuple, not a dataclass:
    the grid makes 8,000 of them per request."""

    uuid: str
    index: int
    model: str
    node: str
    memory_mib: int
    compute_units: int
    slots: int
    mode: str
    pending_mode: str
    state: str  # the one the cell is marked with, worst first (see `card_states`)
    # What the card's slices may add up to: f x its memory on a shared card that oversubscribes
    # (docs/virtual-memory.md), its memory otherwise; the cell fills against it.
    virtual_memory_mib: int
    factor: int  # in hundredths, as the ledger keeps it
    used_memory_mib: int
    used_cores: int
    used_slots: int
    pod_lines: str  # "\nnamespace/name" per active slice: see `pods_per_card`

    @property
    def pods(self) -> tuple[str, ...]:
        """`namespace/name` of each pod on the card, once each, sorted."""
        if not self.pod_lines:
            return ()
        if self.pod_lines.count("\n") == 1:  # most cards hold one slice: nothing to sort
            return (self.pod_lines[1:],)
        return tuple(sorted(set(self.pod_lines[1:].split("\n"))))

    @property
    def free_memory_mib(self) -> int:
        return max(self.virtual_memory_mib - self.used_memory_mib, 0)

    def share(self, colour: str) -> float:
        """Allocated share (0-1) of memory (of what the slices may add up to) or compute, by
        the grid's colour toggle."""
        if colour == "compute":
            return self.used_cores / self.compute_units if self.compute_units else 0.0
        total = self.virtual_memory_mib
        return self.used_memory_mib / total if total else 0.0

    @property
    def memory_line(self) -> str:
        """The tooltip's memory figures: "40960/81920 MiB", or on a card that oversubscribes
        "120000/163840 MiB (81920 MiB x 2)"."""
        line = f"{self.used_memory_mib}/{self.virtual_memory_mib} MiB"
        if self.virtual_memory_mib != self.memory_mib:
            line += f" ({self.memory_mib} MiB x {format_factor(self.factor)})"
        return line


HEALTHY = ("healthy",)


def card_states(
    healthy: bool, present: bool, cordoned: bool, node_cordoned: bool, pending_mode: str
) -> tuple[str, ...]:
    """Every filter state a card matches, worst first: a card can be cordoned and draining at
    once (the cell shows the first, the filter finds it under each)."""
    found = tuple(
        state
        for state, on in (
            ("unhealthy", not healthy or not present),
            ("draining", bool(pending_mode)),
            ("cordoned", cordoned or node_cordoned),
        )
        if on
    )
    return found or HEALTHY


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
    "memory_factor", "node__memory_factor",
)  # fmt: skip


CLAIM = PodBinding.Source.CLAIM


def pods_per_card() -> tuple[dict[int, str], set[str]]:
    """Per card id, "\nnamespace/name" for each of its active slices (a pod with several
    slices there appears as often; a ResourceClaim's as "namespace/name (claim)"), and every
    namespace seen (one query).

    One string per card rather than a collection: strings are not tracked by Python's garbage
    collector, and 8,000 dicts that live through the request made it run full collections that
    cost as much as the queries.
    """
    rows = rawsql.rows_of(
        Slice.objects.filter(active=True)
        .order_by()
        .values_list("card_id", "binding__namespace", "binding__name", "binding__source")
    )
    pods: dict[int, str] = defaultdict(str)
    namespaces = set()
    for card_id, namespace, name, source in rows:
        pods[card_id] += f"\n{namespace}/{name}" + (" (claim)" if source == CLAIM else "")
        namespaces.add(namespace)
    return pods, namespaces


def card_grid(filters: GridFilters) -> Grid:
    """The grid's cells, filtered and sorted, grouped by node (four queries)."""
    rows = rawsql.rows_of(Card.objects.order_by("node__name", "index").values_list(*CARD_ROW))
    held = ledger_usage.card_usage()
    pods, namespaces = pods_per_card()
    models: set[str] = set()
    groups: dict[str, GridNode] = {}
    shown = 0
    for (card_id, uuid, index, model, node, memory, compute, slots, mode, pending, healthy,
         present, cordoned, node_cordoned, ready, own_factor, node_factor) in rows:  # fmt: skip
        models.add(model)
        on_card = pods.get(card_id, "")
        group = groups.get(node)
        if group is None:
            group = groups[node] = GridNode(node, ready, node_cordoned)
        if filters.model and model != filters.model:
            continue
        if filters.namespace and f"\n{filters.namespace}/" not in on_card:
            continue
        if healthy and present and not cordoned and not node_cordoned and not pending:
            states = HEALTHY  # most cards: skip the general rule
        else:
            states = card_states(healthy, present, cordoned, node_cordoned, pending)
        if filters.state and filters.state not in states:
            continue
        used = held.get(card_id, ledger_usage.EMPTY_CARD)
        factor = card_factor(own_factor, node_factor)
        # Only shared cards oversubscribe; MIG, MPS and exclusive cards hold their memory.
        shared = mode == Card.Mode.SHARED
        virtual = virtual_mib(memory, factor) if shared and factor != FACTOR_ONE else memory
        group.cards.append(
            GridCard(
                uuid,
                index,
                model,
                node,
                memory,
                compute,
                slots,
                mode,
                pending,
                states[0],
                virtual,
                factor,
                used.memory_mib,
                used.cores,
                used.slots,
                on_card,
            )
        )
        shown += 1
    nodes = [g for g in groups.values() if g.cards]
    if filters.sort in ("free", "-free"):
        sign = -1 if filters.sort == "free" else 1
        for g in nodes:
            g.cards.sort(key=lambda c: sign * c.free_memory_mib)
        nodes.sort(key=lambda g: (sign * g.free_memory_mib, g.name))
    return Grid(nodes, shown, len(rows), sorted(models), sorted(namespaces))


def _level(share: float) -> int:
    """The colour step of an allocated share: 0 (none) to 10 (full), in tenths rounded up, so a
    card with anything allocated is never drawn as empty."""
    if share <= 0:
        return 0
    return min(10, max(1, int(share * 10 + 0.999)))


STATE_MARK = {"healthy": "", "unhealthy": " sU", "draining": " sD", "cordoned": " sC"}
# NVML UUIDs are letters, digits and dashes (ledger/validation.py): nothing to quote in a URL.
_URL_SAFE = re.compile(r"[A-Za-z0-9._-]+")


def build(filters: GridFilters) -> tuple[Grid, SafeString]:
    """The grid's data and its cells' HTML."""
    data = card_grid(filters)
    return data, render_cells(data.nodes, filters.colour)


def render_cells(nodes: Iterable[GridNode], colour: str) -> SafeString:
    """The grid's HTML: per node a labelled group, per card a linked cell whose class carries
    its colour step (`aN`), its state (`sU` unhealthy, `sD` draining, `sC` cordoned) and its
    mode's mark; the title says the rest:

        GPU 3 · node-a · cordoned
        NVIDIA A100-SXM4-80GB · shared
        memory 40960/81920 MiB · compute 60/100% · slots 3/10
        team-a/train-0, team-b/infer-1

    Every ledger value is escaped (each node, and each model and mode line, once rather than
    once per cell).
    """
    card_prefix = reverse("dashboard:card", args=["x"])[: -len("x/")]
    node_prefix = reverse("dashboard:node", args=["x"])[: -len("x/")]
    kinds: dict[tuple[str, str, str], str] = {}
    out: list[str] = []
    for group in nodes:
        name = escape(group.name)
        out.append(
            f'<div class="gn{"" if group.ready else " nr"}"><a class="gl" '
            f'href="{node_prefix}{quote(group.name)}/">{name}</a>'
        )
        for c in group.cards:
            kind = kinds.get((c.model, c.mode, c.pending_mode))
            if kind is None:
                kind = f"{escape(c.model)} \u00b7 {escape(c.mode)}"
                if c.pending_mode:
                    kind += f" \u2192 {escape(c.pending_mode)} (draining)"
                kinds[(c.model, c.mode, c.pending_mode)] = kind
            uuid = c.uuid if _URL_SAFE.fullmatch(c.uuid) else quote(c.uuid, safe="")
            on_card = c.pods
            pods = on_card[:TOOLTIP_PODS]
            pod_line = escape(", ".join(pods)) if pods else "no pods"
            if len(on_card) > len(pods):
                pod_line += f" and {len(on_card) - len(pods)} more"
            state = "" if c.state == "healthy" else f" \u00b7 {c.state}"
            out.append(
                f'<a class="c a{_level(c.share(colour))}{STATE_MARK[c.state]}'
                f'{MODE_MARK.get(c.mode, "")}" href="{card_prefix}{uuid}/" '
                f'title="GPU {c.index} \u00b7 {name}{state}\n{kind}\n'
                f"memory {c.memory_line} \u00b7 "
                f"compute {c.used_cores}/{c.compute_units}% \u00b7 "
                f'slots {c.used_slots}/{c.slots}\n{pod_line}"></a>'
            )
        out.append("</div>")
    return mark_safe("".join(out))  # noqa: S308 - every ledger value above is escaped
