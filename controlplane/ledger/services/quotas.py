"""Namespace quotas: limits on the GPU memory, compute and slices a namespace holds at once.

Bind checks them under the quota row's lock (taken before the node's), so two pods of one
namespace can never both squeeze under the last of its room.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import IntegrityError, transaction

from controlplane.ledger.errors import Conflict, NotFound, ServiceError
from controlplane.ledger.models import NamespaceQuota
from controlplane.ledger.services.audit import record_event
from controlplane.ledger.validation import NAMESPACE_HELP, is_namespace

# Far beyond any cluster (a million 80 GiB cards); larger is a unit mistake, not a limit.
MAX_QUOTA = {"gpumem_mib": 2**40, "gpucores": 10**9, "gpus": 10**9}


@dataclass(frozen=True, slots=True)
class QuotaLimitsInput:
    """Limits as a caller gives them; None = unlimited."""

    gpumem_mib: int | None = None
    gpucores: int | None = None
    gpus: int | None = None


@dataclass(frozen=True, slots=True)
class QuotaRecord:
    """A namespace's quota as `set_quota` wrote it; None = unlimited."""

    namespace: str
    gpumem_mib: int | None
    gpucores: int | None
    gpus: int | None
    updated_by: str


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
) -> tuple[QuotaRecord, bool]:
    """Create or replace a namespace's quota; returns (quota, created). Audited as `quota-set`.

    Lowering a limit below what the namespace holds now is allowed: running pods keep their
    slices, and new ones are refused until usage falls under it (as with Kubernetes quotas).
    With `create_only`, an existing quota is a Conflict (POST semantics).
    """
    _check_namespace(namespace)
    _check_limits(limits)
    try:
        with transaction.atomic(durable=True):
            return _set_quota(namespace, limits, actor, create_only)
    except IntegrityError:
        # Another request created the same namespace's quota between our read and our insert.
        if create_only:
            raise Conflict(f"namespace {namespace} already has a quota", "namespace") from None
        with transaction.atomic(durable=True):
            return _set_quota(namespace, limits, actor, create_only)


def _set_quota(
    namespace: str, limits: QuotaLimitsInput, actor: str, create_only: bool
) -> tuple[QuotaRecord, bool]:
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
    written = QuotaRecord(namespace, quota.gpumem_mib, quota.gpucores, quota.gpus, quota.updated_by)
    return written, created


@transaction.atomic(durable=True)
def delete_quota(namespace: str, actor: str) -> None:
    """Remove a namespace's quota (it becomes unlimited). Audited as `quota-delete`."""
    _check_namespace(namespace)
    quota = NamespaceQuota.objects.select_for_update().filter(namespace=namespace).first()
    if quota is None:
        raise NotFound(f"namespace {namespace} has no quota", field="namespace")
    before = _limits_of(quota)
    quota.delete()
    record_event(actor, "quota-delete", "quota", namespace, before=before)
