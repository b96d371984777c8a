"""The dashboard's card pages: a card's bar of slices (and a MIG card's layout of instances),
and one card's detail with its health and cordon history. The node pages draw these cards too
(`nodes`). A card that oversubscribes (docs/virtual-memory.md) shows its factor, its virtual and
resident use, and per slice what stays on the card and what spilled."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime

from django.db.models import QuerySet

from controlplane.dashboard.selectors.common import percent
from controlplane.dashboard.selectors.operations import container_usage
from controlplane.ledger import usage as ledger_usage
from controlplane.ledger.models import AuditEvent, Card, Slice
from controlplane.ledger.selectors import card_factor
from controlplane.ledger.services.mode_rules import describe
from controlplane.scheduling import FACTOR_ONE, CardClaim, format_factor, virtual_mib
from controlplane.scheduling.mig import GEOMETRIES, geometry_for

CARD_HEALTH_ACTIONS = ("card-health", "card-missing", "card-returned")
CARD_HISTORY_ACTIONS = (
    *CARD_HEALTH_ACTIONS, "card-cordon", "card-uncordon", "card-mode", "card-mode-requested",
    "card-mode-cancelled", "card-memory-factor",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SliceView:
    """One active slice as drawn in a card's bar."""

    namespace: str
    pod: str
    pod_uid: str
    phase: str
    container: str
    init: bool
    memory_mib: int
    cores: int
    memory_share: float  # percent of the card's memory (of f x it where oversubscribed)
    cores_share: float  # percent of the card's compute
    mig_profile: str = ""  # on a MIG card: the GPU instance's profile and placement
    mig_start: int | None = None
    mig_size: int | None = None
    # Virtual device memory (docs/virtual-memory.md): the slice's resident part (None: all of
    # it), and what its container holds on the card and has spilled, as its node plugin last
    # reported (None: not known).
    resident_mib: int | None = None
    resident_used_mib: int | None = None
    spilled_mib: int | None = None
    # pod: an extender binding; claim: a ResourceClaim's (DRA mode), `pod` is then the claim's
    # name and `container` its request's
    source: str = "pod"


def mig_memory_slices(model: str) -> int:
    """How many memory slices a MIG card of `model` has, for drawing its layout: its MIG
    geometry's (`controlplane.scheduling.mig`), or the most any geometry has for a model the
    table lacks (a placement past that widens the bar)."""
    geometry = geometry_for(model)
    if geometry is not None:
        return geometry.memory_slices
    return max(g.memory_slices for g in GEOMETRIES)


@dataclass(frozen=True, slots=True)
class MigCell:
    """A run of a MIG card's memory slices: one GPU instance, or free (`instance` None)."""

    start: int
    size: int
    width: float  # percent of the card
    instance: SliceView | None = None


@dataclass(slots=True)
class CardView:
    """One card with its allocation and active slices."""

    id: int
    uuid: str
    index: int
    model: str
    memory_mib: int
    compute_units: int
    slots: int
    healthy: bool
    health_reason: str
    cordoned: bool
    present: bool
    node_name: str
    mode: str = Card.Mode.SHARED
    pending_mode: str = ""
    mig_capable: bool = False
    mig_enabled: bool = False
    memory_factor: int | None = None  # the operator's own factor (hundredths); None: the node's
    node_memory_factor: int = FACTOR_ONE  # the node's reported default
    usage: CardClaim = ledger_usage.EMPTY_CARD
    slices: list[SliceView] = field(default_factory=list)

    @property
    def draining(self) -> bool:
        """A mode change waits for the card's slices to end; it takes nothing new meanwhile."""
        return bool(self.pending_mode)

    @property
    def mode_status(self) -> str:
        """The mode in words: "MIG", or "draining: becomes MIG when its 2 slices end"."""
        return describe(self.mode, self.pending_mode, len(self.slices))

    @property
    def mig_instances(self) -> list[SliceView]:
        """The card's GPU instances in the ledger (its active MIG slices), by placement."""
        placed = [s for s in self.slices if s.mig_profile]
        return sorted(placed, key=lambda s: (s.mig_start or 0, s.pod))

    @property
    def mig_layout(self) -> list[MigCell]:
        """The card's memory slices left to right: each instance at its placement, free runs
        between them; widths in percent of the card."""
        instances = self.mig_instances
        total = max(
            mig_memory_slices(self.model),
            max(((s.mig_start or 0) + (s.mig_size or 0) for s in instances), default=0),
        )
        cells: list[MigCell] = []
        at = 0
        for s in instances:
            start, size = s.mig_start or 0, s.mig_size or 0
            if start > at:
                cells.append(MigCell(at, start - at, percent(start - at, total)))
            cells.append(MigCell(start, size, percent(size, total), s))
            at = max(at, start + size)
        if at < total:
            cells.append(MigCell(at, total - at, percent(total - at, total)))
        return cells

    @property
    def spills(self) -> bool:
        """Some slice may spill, or has: the slice table shows resident and spilled MiB."""
        return any(s.resident_mib is not None or s.spilled_mib for s in self.slices)

    @property
    def factor(self) -> int:
        """The oversubscription factor that applies (hundredths, docs/virtual-memory.md)."""
        return card_factor(self.memory_factor, self.node_memory_factor)

    @property
    def factor_text(self) -> str:
        """The factor as people write it: "1", "1.5"."""
        return format_factor(self.factor)

    @property
    def own_factor_text(self) -> str | None:
        """The operator's own factor, None when the card follows its node's."""
        return None if self.memory_factor is None else format_factor(self.memory_factor)

    @property
    def virtual_mib(self) -> int:
        """f x the card's memory: what its slices may add up to."""
        return virtual_mib(self.memory_mib, self.factor)

    @property
    def resident_allocated_mib(self) -> int:
        """What the card's slices keep on the card (their memory less what may spill)."""
        return self.usage.resident

    @property
    def memory_free_mib(self) -> int:
        return max(self.memory_mib - self.usage.memory_mib, 0)

    @property
    def memory_percent(self) -> float:
        return percent(self.usage.memory_mib, self.memory_mib)

    @property
    def compute_percent(self) -> float:
        return percent(self.usage.cores, self.compute_units)

    @property
    def state(self) -> str:
        """One word for the badge: missing, unhealthy, cordoned or healthy (worst first)."""
        if not self.present:
            return "missing"
        if not self.healthy:
            return "unhealthy"
        if self.cordoned:
            return "cordoned"
        return "healthy"


CARD_FIELDS = (
    "id",
    "uuid",
    "index",
    "model",
    "memory_mib",
    "compute_units",
    "slots",
    "healthy",
    "health_reason",
    "cordoned",
    "present",
    "node__name",
    "mode",
    "pending_mode",
    "mig_capable",
    "mig_enabled",
    "memory_factor",
    "node__memory_factor",
)


SLICE_VIEW_FIELDS = (
    *ledger_usage.SLICE_ROW,
    "binding__namespace",
    "binding__name",
    "binding__pod_uid",
    "binding__phase",
    "container_name",
    "mig_profile",
    "binding__source",
)


def card_views(
    cards_qs: QuerySet[Card], slices_qs: QuerySet[Slice] | None = None
) -> list[CardView]:
    """Cards (one query) and their active slices (one query), usage folded per card.

    `slices_qs` narrows the slice query (e.g. by node); by default it is the listed cards' slices.
    """
    cards = [CardView(*row) for row in cards_qs.values_list(*CARD_FIELDS)]
    by_id = {c.id: c for c in cards}
    if slices_qs is None:
        slices_qs = Slice.objects.filter(card_id__in=list(by_id))
    # Rows named by their fields (`row.card_id`, `row.binding__name`): no position to drift.
    rows = list(slices_qs.filter(active=True).values_list(*SLICE_VIEW_FIELDS, named=True))
    # the core folds its own leading columns (`ledger_usage.SLICE_ROW`)
    width = len(ledger_usage.SLICE_ROW)
    for card_id, claim in ledger_usage.claims_of(r[:width] for r in rows).items():
        if card_id in by_id:
            by_id[card_id].usage = claim
    for row in rows:
        card = by_id.get(row.card_id)
        if card is None:
            continue
        card.slices.append(
            SliceView(
                row.binding__namespace,
                row.binding__name,
                row.binding__pod_uid,
                row.binding__phase,
                row.container_name,
                row.init_container,
                row.memory_mib,
                row.compute_percent,
                percent(row.memory_mib, card.virtual_mib),  # the bar is f x the memory
                percent(row.compute_percent, card.compute_units),
                row.mig_profile,
                row.mig_start,
                row.mig_size,
                row.resident_mib,
                source=row.binding__source,
            )
        )
    for card in cards:
        card.slices.sort(key=lambda s: (s.init, s.namespace, s.pod, s.container))
    return cards


@dataclass(frozen=True, slots=True)
class CardDetail:
    """A card, its node's flags, its slices and its health/cordon history."""

    card: CardView
    node_ready: bool
    node_cordoned: bool
    numa_node: int | None
    last_seen: datetime | None
    history: list[AuditEvent]


def card_detail(uuid: str) -> CardDetail | None:
    """One card (three queries: card, slices, history), or None when no such card."""
    extra = (
        Card.objects.filter(uuid=uuid)
        .values_list("node__ready", "node__cordoned", "numa_node", "last_seen")
        .first()
    )
    if extra is None:
        return None
    cards = card_views(Card.objects.filter(uuid=uuid), Slice.objects.filter(card__uuid=uuid))
    card = cards[0]
    if card.spills:  # one more query, only on a card whose slices may spill
        used = container_usage({card.node_name})
        card.slices = [
            replace(
                s,
                resident_used_mib=sample.get("memory_resident_mib"),
                spilled_mib=sample.get("memory_spilled_mib"),
            )
            for s in card.slices
            for sample in [used.get((card.node_name, s.namespace, s.pod, s.container, uuid), {})]
        ]
    history = list(
        AuditEvent.objects.filter(
            target_type="card", target=uuid, action__in=CARD_HISTORY_ACTIONS
        ).order_by("-at", "-id")[:100]
    )
    return CardDetail(card, *extra, history)
