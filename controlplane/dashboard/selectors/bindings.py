"""The bindings page and API, and one pod's page: pod <-> card bindings with the slices they
hold (or held), and where a pod stands (`controlplane.ledger.why`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.core.paginator import Page, Paginator
from django.db.models import QuerySet

from controlplane.dashboard.selectors.common import PAGE_SIZE
from controlplane.ledger import why
from controlplane.ledger.models import PodBinding, SchedulingDecision, Slice

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
    source: str  # pod | claim (a ResourceClaim's row, DRA mode)
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
    "source",
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
