"""The quotas page and API: each namespace's limits beside what it holds now."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from controlplane.dashboard.selectors.common import percent
from controlplane.ledger import usage as ledger_usage
from controlplane.ledger.models import NamespaceQuota
from controlplane.scheduling import QuotaUsage


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
        return percent(self.used_memory_mib, self.gpumem_mib) if self.gpumem_mib else None

    @property
    def cores_percent(self) -> float | None:
        return percent(self.used_cores, self.gpucores) if self.gpucores else None

    @property
    def gpus_percent(self) -> float | None:
        return percent(self.used_gpus, self.gpus) if self.gpus else None


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
