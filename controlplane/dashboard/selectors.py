"""Reads for the dashboard, the operations API and /metrics, in a fixed number of queries.

Every selector here issues the same number of queries however many nodes, cards and slices
there are (tests lock the counts): rows come from `values_list` and are folded in one pass in
Python. How full a card or a namespace is comes from the ledger's one usage arithmetic
(`controlplane.ledger.usage`, the scheduling core's rule), so the dashboard and the scheduler
never disagree; where's a pod stands, from `controlplane.ledger.why`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.paginator import Page, Paginator
from django.db.models import Count, Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from controlplane import rawsql
from controlplane.dashboard.models import AllocationSample
from controlplane.ledger import usage as ledger_usage
from controlplane.ledger import why
from controlplane.ledger.models import (
    AuditEvent,
    Card,
    NamespaceQuota,
    Node,
    Nomination,
    PodBinding,
    SchedulingDecision,
    Slice,
)
from controlplane.ledger.services.mode_rules import describe
from controlplane.scheduling import CardClaim, QuotaUsage

PAGE_SIZE = 50
CARD_HEALTH_ACTIONS = ("card-health", "card-missing", "card-returned")
CARD_HISTORY_ACTIONS = (
    *CARD_HEALTH_ACTIONS, "card-cordon", "card-uncordon", "card-mode", "card-mode-requested",
    "card-mode-cancelled",
)  # fmt: skip
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


# --- overview ------------------------------------------------------------------------------------


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
        return _percent(self.memory_allocated_mib, self.memory_total_mib)

    @property
    def compute_percent(self) -> float:
        return _percent(self.compute_allocated, self.compute_total)

    @property
    def slots_percent(self) -> float:
        return _percent(self.slots_allocated, self.slots_total)


def _percent(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


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


# --- nodes and cards -----------------------------------------------------------------------------


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
    memory_share: float  # percent of the card's memory
    cores_share: float  # percent of the card's compute
    mig_profile: str = ""  # on a MIG card: the GPU instance's profile and placement
    mig_start: int | None = None
    mig_size: int | None = None


def mig_memory_slices(model: str) -> int:
    """How many memory slices a MIG card of `model` has, for drawing its layout: the A30 has 4,
    NVIDIA's other MIG GPUs 8 (a placement past that widens the bar)."""
    return 4 if "A30" in model.upper() else 8


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
                cells.append(MigCell(at, start - at, _percent(start - at, total)))
            cells.append(MigCell(start, size, _percent(size, total), s))
            at = max(at, start + size)
        if at < total:
            cells.append(MigCell(at, total - at, _percent(total - at, total)))
        return cells

    @property
    def memory_free_mib(self) -> int:
        return max(self.memory_mib - self.usage.memory_mib, 0)

    @property
    def memory_percent(self) -> float:
        return _percent(self.usage.memory_mib, self.memory_mib)

    @property
    def compute_percent(self) -> float:
        return _percent(self.usage.cores, self.compute_units)

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
)
SLICE_VIEW_FIELDS = (
    *ledger_usage.SLICE_ROW,
    "binding__namespace",
    "binding__name",
    "binding__pod_uid",
    "binding__phase",
    "container_name",
    "mig_profile",
    "mig_start",
    "mig_size",
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
    rows = list(slices_qs.filter(active=True).values_list(*SLICE_VIEW_FIELDS))
    width = len(ledger_usage.SLICE_ROW)
    for card_id, claim in ledger_usage.claims_of(r[:width] for r in rows).items():
        if card_id in by_id:
            by_id[card_id].usage = claim
    for row in rows:
        _, card_id, _, init, memory, cores, _, namespace, pod, uid, phase, container = row[:12]
        card = by_id.get(card_id)
        if card is None:
            continue
        card.slices.append(
            SliceView(
                namespace,
                pod,
                uid,
                phase,
                container,
                init,
                memory,
                cores,
                _percent(memory, card.memory_mib),
                _percent(cores, card.compute_units),
                *row[12:],
            )
        )
    for card in cards:
        card.slices.sort(key=lambda s: (s.init, s.namespace, s.pod, s.container))
    return cards


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
    history = list(
        AuditEvent.objects.filter(
            target_type="card", target=uuid, action__in=CARD_HISTORY_ACTIONS
        ).order_by("-at", "-id")[:100]
    )
    return CardDetail(cards[0], *extra, history)


# --- bindings and pods ---------------------------------------------------------------------------

BINDING_SORTS = {
    "pod": ("name", "namespace"),
    "namespace": ("namespace", "name"),
    "node": ("node__name", "namespace", "name"),
    "phase": ("phase", "namespace", "name"),
    "created": ("created_at", "id"),
}
DEFAULT_BINDING_SORT = "-created"


@dataclass(frozen=True, slots=True)
class BindingFilters:
    """What the bindings page and API filter by; empty strings mean "any"."""

    q: str = ""
    namespace: str = ""
    node: str = ""
    card: str = ""
    phase: str = ""
    sort: str = DEFAULT_BINDING_SORT


def binding_queryset(f: BindingFilters) -> QuerySet[PodBinding]:
    """Bindings matching the filters, sorted. `card` matches a card UUID the pod holds or held."""
    qs = PodBinding.objects.all()
    if f.q:
        qs = qs.filter(name__icontains=f.q)
    if f.namespace:
        qs = qs.filter(namespace=f.namespace)
    if f.node:
        qs = qs.filter(node__name=f.node)
    if f.phase:
        qs = qs.filter(phase=f.phase)
    if f.card:
        qs = qs.filter(pk__in=Slice.objects.filter(card__uuid=f.card).values("binding_id"))
    key = f.sort.lstrip("-")
    order = BINDING_SORTS.get(key, BINDING_SORTS["created"])
    if f.sort.startswith("-"):
        order = tuple(f"-{o}" for o in order)
    return qs.order_by(*order)


@dataclass(slots=True)
class BindingView:
    """A binding row with the cards it holds (or held) and its totals."""

    id: int
    pod_uid: str
    namespace: str
    name: str
    node_name: str | None
    phase: str
    reason: str
    created_at: datetime
    reserved_at: datetime | None
    bound_at: datetime | None
    released_at: datetime | None
    slices: list[dict[str, Any]] = field(default_factory=list)

    @property
    def memory_mib(self) -> int:
        return sum(s["memory_mib"] for s in self.slices if not s["init"])

    @property
    def cores(self) -> int:
        return sum(s["cores"] for s in self.slices if not s["init"])

    @property
    def cards(self) -> list[str]:
        return sorted({s["card_uuid"] for s in self.slices})


BINDING_FIELDS = (
    "id",
    "pod_uid",
    "namespace",
    "name",
    "node__name",
    "phase",
    "reason",
    "created_at",
    "reserved_at",
    "bound_at",
    "released_at",
)


def binding_views(qs: QuerySet[PodBinding]) -> list[BindingView]:
    """Bindings (one query) with their slices (one query)."""
    bindings = [BindingView(*row) for row in qs.values_list(*BINDING_FIELDS)]
    by_id = {b.id: b for b in bindings}
    slices = Slice.objects.filter(binding_id__in=list(by_id)).order_by(
        "binding_id", "init_container", "container_index", "card__index"
    )
    for row in slices.values_list(
        "binding_id",
        "container_name",
        "container_index",
        "init_container",
        "card__uuid",
        "card__index",
        "card__node__name",
        "memory_mib",
        "compute_percent",
        "active",
    ):
        by_id[row[0]].slices.append(
            dict(
                zip(
                    (
                        "container",
                        "container_index",
                        "init",
                        "card_uuid",
                        "card_index",
                        "node",
                        "memory_mib",
                        "cores",
                        "active",
                    ),
                    row[1:],
                    strict=True,
                )
            )
        )
    return bindings


def binding_page(f: BindingFilters, page: int | str = 1, per_page: int = PAGE_SIZE) -> Page:
    """One page of bindings: three queries (count, rows, slices)."""
    paginator = Paginator(binding_queryset(f), per_page)
    current = paginator.get_page(page)
    current.object_list = binding_views(current.object_list)
    return current


def binding_namespaces() -> list[str]:
    """Namespaces that have (or had) bindings, for the filter's choices (one query)."""
    return list(
        PodBinding.objects.order_by("namespace").values_list("namespace", flat=True).distinct()
    )


@dataclass(frozen=True, slots=True)
class PodDetail:
    """What Tessera knows about one pod: its latest binding and its latest decision."""

    namespace: str
    name: str
    binding: BindingView | None
    decision: SchedulingDecision | None
    earlier_bindings: int
    status: why.PodStatus | None

    @property
    def why(self) -> str:
        """Where the pod stands, in plain words (the same answer as the REST API's)."""
        if self.status is None:
            return (
                "Tessera has no record of this pod: it asks for no managed GPU resource, or the "
                "scheduler has not yet asked the extender about it."
            )
        return self.status.text


def pod_detail(namespace: str, name: str) -> PodDetail:
    """The pod's most recent binding and decision: four queries."""
    bindings = PodBinding.objects.filter(namespace=namespace, name=name).order_by(
        "-created_at", "-id"
    )
    views = binding_views(bindings[:1])
    earlier = bindings.count() - len(views)
    decision = (
        SchedulingDecision.objects.filter(namespace=namespace, name=name)
        .order_by("-decided_at", "-id")
        .first()
    )
    binding = views[0] if views else None
    facts = None
    if binding is not None:
        facts = why.BindingFacts(
            binding.pod_uid, binding.phase, binding.node_name, binding.reason, binding.created_at,
            binding.reserved_at, tuple(binding.cards), binding.memory_mib, binding.cores,
        )  # fmt: skip
    status = why.explain(namespace, name, facts, decision)
    return PodDetail(namespace, name, binding, decision, earlier, status)


# --- quotas --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuotaRow:
    """A namespace's limits (None = unlimited) beside what it holds now."""

    namespace: str
    has_quota: bool
    gpumem_mib: int | None
    gpucores: int | None
    gpus: int | None
    used_memory_mib: int
    used_cores: int
    used_gpus: int
    updated_at: datetime | None
    updated_by: str

    @property
    def memory_percent(self) -> float | None:
        return _percent(self.used_memory_mib, self.gpumem_mib) if self.gpumem_mib else None

    @property
    def cores_percent(self) -> float | None:
        return _percent(self.used_cores, self.gpucores) if self.gpucores else None

    @property
    def gpus_percent(self) -> float | None:
        return _percent(self.used_gpus, self.gpus) if self.gpus else None


def quota_rows(namespace: str | None = None) -> list[QuotaRow]:
    """Every namespace with a quota or with usage (three queries), by namespace name."""
    quotas = NamespaceQuota.objects.all()
    if namespace is not None:
        quotas = quotas.filter(namespace=namespace)
    limits = {
        q[0]: q[1:]
        for q in quotas.values_list(
            "namespace", "gpumem_mib", "gpucores", "gpus", "updated_at", "updated_by"
        )
    }
    held = ledger_usage.namespace_usage(namespace)
    rows = []
    for ns in sorted(limits.keys() | held.keys()):
        mem, cores, gpus, updated_at, updated_by = limits.get(ns, (None, None, None, None, ""))
        used = held.get(ns) or QuotaUsage()
        rows.append(
            QuotaRow(
                ns,
                ns in limits,
                mem,
                cores,
                gpus,
                used.memory_mib,
                used.cores,
                used.gpus,
                updated_at,
                updated_by,
            )
        )
    return rows


# --- audit ---------------------------------------------------------------------------------------


def audit_queryset(action: str = "", target: str = "", actor: str = "") -> QuerySet[AuditEvent]:
    """Audit events, newest first, filtered by exact action and target/actor substrings."""
    qs = AuditEvent.objects.order_by("-at", "-id")
    if action:
        qs = qs.filter(action=action)
    if target:
        qs = qs.filter(target__icontains=target)
    if actor:
        qs = qs.filter(actor__icontains=actor)
    return qs


def audit_page(action: str = "", target: str = "", actor: str = "", page: int | str = 1) -> Page:
    """One page of audit events (two queries: count, rows)."""
    return Paginator(audit_queryset(action, target, actor), PAGE_SIZE).get_page(page)


def audit_actions() -> list[str]:
    """The actions recorded so far, for the filter's choices (one query)."""
    return list(AuditEvent.objects.order_by("action").values_list("action", flat=True).distinct())


# --- slices (operations API) ---------------------------------------------------------------------

SLICE_API_FIELDS = {
    "namespace": "binding__namespace",
    "pod": "binding__name",
    "pod_uid": "binding__pod_uid",
    "phase": "binding__phase",
    "container": "container_name",
    "container_index": "container_index",
    "init": "init_container",
    "node": "card__node__name",
    "card": "card__uuid",
    "memory_mib": "memory_mib",
    "compute_percent": "compute_percent",
    "active": "active",
}


def slice_queryset(
    node: str = "", card: str = "", namespace: str = "", pod: str = "", active: bool | None = True
) -> QuerySet[Slice]:
    """Slices by node, card UUID, namespace, pod name and active flag (None = any)."""
    qs = Slice.objects.order_by("-binding_id", "init_container", "container_index", "id")
    if node:
        qs = qs.filter(card__node__name=node)
    if card:
        qs = qs.filter(card__uuid=card)
    if namespace:
        qs = qs.filter(binding__namespace=namespace)
    if pod:
        qs = qs.filter(binding__name=pod)
    if active is not None:
        qs = qs.filter(active=active)
    return qs


def slice_dicts(qs: QuerySet[Slice]) -> list[dict[str, Any]]:
    """Rows of `slice_queryset` as plain dicts, each active one with what its container uses
    now where its node's plugin reported that recently (two queries)."""
    names = list(SLICE_API_FIELDS)
    rows = [
        dict(zip(names, row, strict=True)) for row in qs.values_list(*SLICE_API_FIELDS.values())
    ]
    used = container_usage({r["node"] for r in rows if r["active"]})
    for r in rows:
        key = (r["node"], r["namespace"], r["pod"], r["container"], r["card"])
        sample = used.get(key, {}) if r["active"] else {}
        r["memory_used_mib"] = sample.get("memory_used_mib")
        r["compute_used_percent"] = sample.get("compute_used_percent")
        r["used_at"] = sample.get("at")
    return rows


UsageKey = tuple[str, str, str, str, str]  # node, namespace, pod, container, card UUID


def container_usage(nodes: set[str]) -> dict[UsageKey, dict[str, Any]]:
    """What each container uses of each card on `nodes`, from their plugins' latest reports;
    a report older than a node is allowed to stay silent is left out (figures that old would
    be read as now)."""
    if not nodes:
        return {}
    cutoff = timezone.now() - timedelta(seconds=settings.TESSERA["NODE_STALE_AFTER_S"])
    reports = Node.objects.filter(name__in=nodes, usage_at__gte=cutoff).values_list(
        "name", "usage", "usage_at"
    )
    out: dict[UsageKey, dict[str, Any]] = {}
    for node, entries, at in reports:
        for e in entries:
            key = (node, e["namespace"], e["pod"], e["container"], e["card"])
            out[key] = {**e, "at": at}
    return out


def card_queryset(
    node: str = "",
    healthy: bool | None = None,
    cordoned: bool | None = None,
    present: bool | None = None,
    model: str = "",
) -> QuerySet[Card]:
    """Cards by node name, flags and model substring, ordered by node and index."""
    qs = Card.objects.order_by("node__name", "index", "id")
    if node:
        qs = qs.filter(node__name=node)
    if healthy is not None:
        qs = qs.filter(healthy=healthy)
    if cordoned is not None:
        qs = qs.filter(cordoned=cordoned)
    if present is not None:
        qs = qs.filter(present=present)
    if model:
        qs = qs.filter(model__icontains=model)
    return qs


def node_filter(
    name: str = "",
    ready: bool | None = None,
    cordoned: bool | None = None,
    healthy: bool | None = None,
) -> QuerySet[Node]:
    """Nodes for the API: name substring, flags; healthy = every card healthy and present."""
    qs = Node.objects.order_by("name")
    if name:
        qs = qs.filter(name__icontains=name)
    if ready is not None:
        qs = qs.filter(ready=ready)
    if cordoned is not None:
        qs = qs.filter(cordoned=cordoned)
    if healthy is not None:
        sick = Card.objects.filter(Q(healthy=False) | Q(present=False)).values("node_id")
        qs = qs.exclude(pk__in=sick) if healthy else qs.filter(pk__in=sick)
    return qs


# --- access (admin) ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UserRow:
    """A user with their Tessera role and token counts, for the admin's access page."""

    username: str
    role: str | None
    is_active: bool
    last_login: datetime | None
    tokens_active: int


def access_users() -> list[UserRow]:
    """Every user with role and live token count (two queries)."""
    from django.contrib.auth import get_user_model

    from controlplane.access.roles import role_from_groups

    users = list(
        get_user_model()
        .objects.order_by("username")
        .annotate(tokens_active=Count("api_tokens", filter=Q(api_tokens__revoked=False)))
        .values_list("id", "username", "is_superuser", "is_active", "last_login", "tokens_active")
    )
    groups: dict[int, set[str]] = defaultdict(set)
    through = get_user_model().groups.through
    for user_id, name in through.objects.values_list("user_id", "group__name"):
        groups[user_id].add(name)
    rows = []
    for user_id, username, superuser, active, last_login, tokens in users:
        role = role_from_groups(groups[user_id], superuser)  # no query per user
        rows.append(UserRow(username, role.value if role else None, active, last_login, tokens))
    return rows


def access_tokens(limit: int = 200) -> list[dict[str, Any]]:
    """The newest API tokens (digest never included), one query."""
    from controlplane.access.models import ApiToken

    return list(
        ApiToken.objects.order_by("revoked", "-created_at").values(
            "id",
            "prefix",
            "label",
            "user__username",
            "created_at",
            "last_used_at",
            "expires_at",
            "revoked",
        )[:limit]
    )
