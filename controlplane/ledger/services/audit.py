"""Audit events: who changed what (quotas, cordons, tokens, repairs), in the change's own
transaction so the record commits, or rolls back, with it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from controlplane.ledger.models import AuditEvent


def record_event(
    actor: str, action: str, target_type: str, target: str, **details: Any
) -> AuditEvent:
    """Append one audit event inside the caller's transaction."""
    return AuditEvent.objects.create(
        actor=actor[:150],
        action=action,
        target_type=target_type,
        target=target[:253],
        details=details,
    )


def record_events(
    actor: str, action: str, target_type: str, events: Iterable[tuple[str, dict[str, Any]]]
) -> None:
    """Append many events of one kind in one statement: (target, details) each."""
    AuditEvent.objects.bulk_create(
        AuditEvent(
            actor=actor[:150],
            action=action,
            target_type=target_type,
            target=target[:253],
            details=details,
        )
        for target, details in events
    )
