"""The audit page: every recorded change, newest first."""

from __future__ import annotations

from django.core.paginator import Page, Paginator
from django.db.models import QuerySet

from controlplane.dashboard.selectors.common import PAGE_SIZE
from controlplane.ledger.models import AuditEvent


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
