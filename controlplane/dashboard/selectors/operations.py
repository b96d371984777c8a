"""The operations API's lists: slices with what their containers use now, cards and nodes by
their flags."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import Q, QuerySet
from django.utils import timezone

from controlplane.ledger.models import Card, Node, Slice

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
    "resident_mib": "resident_mib",
    "compute_percent": "compute_percent",
    "active": "active",
    "source": "binding__source",
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
        r["memory_resident_mib"] = sample.get("memory_resident_mib")
        r["memory_spilled_mib"] = sample.get("memory_spilled_mib")
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
