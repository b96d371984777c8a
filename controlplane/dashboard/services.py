"""Services of the dashboard: its allocation samples, and (for admins) roles and API tokens.

Quotas and cordons are ledger services (`controlplane.ledger.services.quotas`, `cordons`). Each
change a person makes here is recorded as an audit event with the actor, in the same transaction
as the change.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from controlplane.access.roles import Role
from controlplane.access.services import create_token, grant_role
from controlplane.dashboard.models import AllocationSample
from controlplane.dashboard.selectors import Overview
from controlplane.ledger.services.audit import record_event

SAMPLE_RETENTION = timedelta(days=7)


def sample_bucket(now: datetime) -> datetime:
    """The minute a sample at `now` belongs to."""
    return now.replace(second=0, microsecond=0)


def record_allocation_sample(overview: Overview, now: datetime | None = None) -> AllocationSample:
    """Store this minute's sample unless one exists; prune samples past the retention.

    Idempotent per minute: the bucket is unique and the insert ignores a conflict, so replicas
    and page views racing on the same minute store one row (the first one's figures). Returns
    the minute's row.
    """
    now = now or timezone.now()
    bucket = sample_bucket(now)
    with transaction.atomic():
        AllocationSample.objects.bulk_create(
            [
                AllocationSample(
                    bucket=bucket,
                    cards=overview.cards,
                    memory_total_mib=overview.memory_total_mib,
                    memory_allocated_mib=overview.memory_allocated_mib,
                    compute_total=overview.compute_total,
                    compute_allocated=overview.compute_allocated,
                    slices=overview.slices,
                    pending_pods=overview.pending_pods,
                )
            ],
            ignore_conflicts=True,
        )
        AllocationSample.objects.filter(bucket__lt=bucket - SAMPLE_RETENTION).delete()
        return AllocationSample.objects.get(bucket=bucket)


def sample_due(latest: AllocationSample | None, now: datetime | None = None) -> bool:
    """Whether this minute has no sample yet (so a page view should record one)."""
    now = now or timezone.now()
    return latest is None or latest.bucket < sample_bucket(now)


# --- access (admin) ------------------------------------------------------------------------------


def grant_user_role(username: str, role: Role, actor: str) -> None:
    """Give `username` (created if new, with no password) exactly one Tessera role. Audited."""
    with transaction.atomic():
        grant_role(username, role)
        record_event(actor, "role-grant", "user", username, role=role.value)


def issue_token(username: str, role: Role, label: str, actor: str) -> str:
    """Grant `role` and return a new API token for `username`, shown only now. Audited (the
    event names the token's prefix, never the token)."""
    with transaction.atomic():
        token = create_token(username, role, label)
        record_event(
            actor, "token-create", "user", username, role=role.value, prefix=token[:10], label=label
        )
    return token
