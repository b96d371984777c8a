"""Services of the dashboard and operations API: the only code here that writes rows.

Quotas, cordons, allocation samples, and (for admins) roles and API tokens. Each change that a
person makes is recorded as an AuditEvent with the actor, in the same transaction as the change.
Lock order matches the ledger's services (quota, then node), so a cordon or a quota edit can never
deadlock a bind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.access.models import ApiToken
from controlplane.access.roles import Role
from controlplane.access.services import create_token, grant_role
from controlplane.dashboard.models import AllocationSample
from controlplane.dashboard.selectors import Overview
from controlplane.ledger.models import Card, NamespaceQuota, Node
from controlplane.ledger.services import Conflict, NotFound, ServiceError, record_event
from controlplane.ledger.validation import (
    NAMESPACE_HELP,
    NODE_NAME_HELP,
    is_namespace,
    is_node_name,
)

# Far beyond any cluster (a million 80 GiB cards); larger is a unit mistake, not a limit.
MAX_QUOTA = {"gpumem_mib": 2**40, "gpucores": 10**9, "gpus": 10**9}
SAMPLE_RETENTION = timedelta(days=7)
USERNAME = re.compile(r"^[\w.@+-]{1,150}$")  # Django's username rule


@dataclass(frozen=True, slots=True)
class QuotaLimitsInput:
    """Limits as a caller gives them; None = unlimited."""

    gpumem_mib: int | None = None
    gpucores: int | None = None
    gpus: int | None = None


def _check_limits(limits: QuotaLimitsInput) -> None:
    for name, ceiling in MAX_QUOTA.items():
        value = getattr(limits, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ServiceError(f"{name}: must be a whole number or null (unlimited)", field=name)
        if value < 0:
            raise ServiceError(
                f"{name}: {value} is negative; give 0 or more, or null for unlimited", field=name
            )
        if value > ceiling:
            raise ServiceError(f"{name}: {value} is over the ceiling of {ceiling}", field=name)


def _check_namespace(namespace: str) -> None:
    if not isinstance(namespace, str) or not is_namespace(namespace):
        raise ServiceError(
            f"namespace: {namespace!r} is not a valid namespace name: {NAMESPACE_HELP}",
            field="namespace",
        )


def _limits_of(quota: NamespaceQuota) -> dict[str, int | None]:
    return {"gpumem_mib": quota.gpumem_mib, "gpucores": quota.gpucores, "gpus": quota.gpus}


def set_quota(
    namespace: str, limits: QuotaLimitsInput, actor: str, *, create_only: bool = False
) -> tuple[NamespaceQuota, bool]:
    """Create or replace a namespace's quota; returns (quota, created). Audited as `quota-set`.

    Lowering a limit below what the namespace holds now is allowed: running pods keep their
    slices, and new ones are refused until usage falls under it (as with Kubernetes quotas).
    With `create_only`, an existing quota is a Conflict (POST semantics).
    """
    _check_namespace(namespace)
    _check_limits(limits)
    try:
        with transaction.atomic():
            return _set_quota(namespace, limits, actor, create_only)
    except IntegrityError:
        # Another request created the same namespace's quota between our read and our insert.
        if create_only:
            raise Conflict(f"namespace {namespace} already has a quota", "namespace") from None
        with transaction.atomic():
            return _set_quota(namespace, limits, actor, create_only)


def _set_quota(
    namespace: str, limits: QuotaLimitsInput, actor: str, create_only: bool
) -> tuple[NamespaceQuota, bool]:
    quota = NamespaceQuota.objects.select_for_update().filter(namespace=namespace).first()
    if quota is not None and create_only:
        raise Conflict(
            f"namespace {namespace} already has a quota; PUT /api/v1/quotas/{namespace}/ to "
            "replace it or PATCH to change some limits",
            field="namespace",
        )
    created = quota is None
    before = None if quota is None else _limits_of(quota)
    if quota is None:
        quota = NamespaceQuota(namespace=namespace)
    quota.gpumem_mib, quota.gpucores, quota.gpus = limits.gpumem_mib, limits.gpucores, limits.gpus
    quota.updated_by = actor[:150]
    quota.save()
    record_event(actor, "quota-set", "quota", namespace, before=before, after=_limits_of(quota))
    return quota, created


@transaction.atomic
def delete_quota(namespace: str, actor: str) -> None:
    """Remove a namespace's quota (it becomes unlimited). Audited as `quota-delete`."""
    _check_namespace(namespace)
    quota = NamespaceQuota.objects.select_for_update().filter(namespace=namespace).first()
    if quota is None:
        raise NotFound(f"namespace {namespace} has no quota", field="namespace")
    before = _limits_of(quota)
    quota.delete()
    record_event(actor, "quota-delete", "quota", namespace, before=before)


@transaction.atomic
def set_node_cordon(name: str, cordoned: bool, actor: str, reason: str = "") -> Node:
    """Cordon (place nothing new) or uncordon a node. Audited when the flag changes.

    Takes the node's row lock, as bind does, so a bind in flight either sees the cordon or
    committed before it.
    """
    if not is_node_name(name):
        raise ServiceError(f"name: {name!r} is not a valid node name: {NODE_NAME_HELP}", "name")
    node = Node.objects.select_for_update().filter(name=name).first()
    if node is None:
        raise NotFound(f"node {name!r} is not registered with Tessera", field="name")
    if node.cordoned != cordoned:
        node.cordoned = cordoned
        node.save(update_fields=["cordoned", "updated_at"])
        action = "node-cordon" if cordoned else "node-uncordon"
        record_event(actor, action, "node", name, reason=reason[:500])
    return node


@transaction.atomic
def set_card_cordon(uuid: str, cordoned: bool, actor: str, reason: str = "") -> Card:
    """Cordon or uncordon one card. Audited when the flag changes; locks the card's node first."""
    card = Card.objects.filter(uuid=uuid).only("id", "node_id").first()
    if card is None:
        raise NotFound(f"card {uuid!r} is not registered with Tessera", field="uuid")
    Node.objects.select_for_update().filter(pk=card.node_id).first()
    card = Card.objects.select_for_update(of=("self",)).select_related("node").get(pk=card.pk)
    if card.cordoned != cordoned:
        card.cordoned = cordoned
        card.save(update_fields=["cordoned", "updated_at"])
        action = "card-cordon" if cordoned else "card-uncordon"
        record_event(actor, action, "card", uuid, node=card.node.name, reason=reason[:500])
    return card


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
    _check_username(username)
    with transaction.atomic():
        grant_role(username, role)
        record_event(actor, "role-grant", "user", username, role=role.value)


def issue_token(username: str, role: Role, label: str, actor: str) -> str:
    """Grant `role` and return a new API token for `username`, shown only now. Audited (the
    event names the token's prefix, never the token)."""
    _check_username(username)
    with transaction.atomic():
        token = create_token(username, role, label)
        record_event(
            actor, "token-create", "user", username, role=role.value, prefix=token[:10], label=label
        )
    return token


@transaction.atomic
def revoke_token(token_id: int, actor: str) -> ApiToken:
    """Revoke an API token (it authenticates nobody from now on). Audited; idempotent."""
    token = ApiToken.objects.select_for_update().select_related("user").filter(pk=token_id).first()
    if token is None:
        raise NotFound(f"no API token {token_id}", field="token")
    if not token.revoked:
        token.revoked = True
        token.save(update_fields=["revoked"])
        record_event(actor, "token-revoke", "user", token.user.get_username(), prefix=token.prefix)
    return token


def _check_username(username: str) -> None:
    if not isinstance(username, str) or not USERNAME.match(username):
        raise ServiceError("username: 1 to 150 letters, digits and @.+-_ only", field="username")
