"""Namespace quota arithmetic: how much a pod takes, and whether it may take it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.scheduling.claims import CardClaim
from controlplane.scheduling.request import PodRequest
from controlplane.scheduling.result import ReasonCode, Refusal


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """A namespace's ceilings; ``None`` means unlimited."""

    memory_mib: int | None
    cores: int | None
    gpus: int | None


@dataclass(frozen=True, slots=True)
class QuotaUsage:
    """GPU memory (MiB), compute (percent of a card, summed) and slices (slots claimed)."""

    memory_mib: int = 0
    cores: int = 0
    gpus: int = 0

    def __ge__(self, other: QuotaUsage) -> bool:
        """Every dimension at least ``other``'s."""
        if not isinstance(other, QuotaUsage):
            return NotImplemented
        return (
            self.memory_mib >= other.memory_mib
            and self.cores >= other.cores
            and self.gpus >= other.gpus
        )

    def __add__(self, other: QuotaUsage) -> QuotaUsage:
        if not isinstance(other, QuotaUsage):
            return NotImplemented
        return QuotaUsage(
            memory_mib=self.memory_mib + other.memory_mib,
            cores=self.cores + other.cores,
            gpus=self.gpus + other.gpus,
        )


def usage_of(claims: Mapping[str, CardClaim] | Mapping[int, CardClaim]) -> QuotaUsage:
    """What one pod counts against its namespace: the sum of its per-card claims.

    Counting claims (not raw slices) charges init containers at their peak, the same room
    the scheduler keeps for them.
    """
    return QuotaUsage(
        memory_mib=sum(c.memory_mib for c in claims.values()),
        cores=sum(c.cores for c in claims.values()),
        gpus=sum(c.slots for c in claims.values()),
    )


def least_demand(request: PodRequest, card_memory_mib: int) -> QuotaUsage:
    """A lower bound of what any placement of the pod counts against its quota, with
    percentage and whole-card asks valued on a card of ``card_memory_mib`` (the smallest card
    it could get).

    Per dimension the pod's peak (PodRequest.peak): its app containers with its sidecars, or
    an init container with the sidecars started before it. Where slices share a card the claim
    is the larger of the two there (claims.claims_per_card), and summed over cards that is
    never below either total.
    """
    return QuotaUsage(
        memory_mib=request.peak(lambda c: c.gpus * c.memory_on(card_memory_mib)),
        cores=request.peak(lambda c: c.gpus * c.cores),
        gpus=request.peak(lambda c: c.gpus),
    )


def check_quota(
    namespace: str, limits: QuotaLimits, used: QuotaUsage, demand: QuotaUsage
) -> Refusal | None:
    """None when ``used + demand`` stays within every limit, else one QUOTA_EXCEEDED refusal.

    The message names every exceeded dimension with its used, demand and limit figures. It
    is permanent when the demand alone is over a limit: no pod ending in the namespace helps.
    """
    over: list[str] = []
    permanent = False
    for label, unit, limit, have, want in (
        ("GPU memory", " MiB", limits.memory_mib, used.memory_mib, demand.memory_mib),
        ("GPU compute", "%", limits.cores, used.cores, demand.cores),
        ("GPU slices", "", limits.gpus, used.gpus, demand.gpus),
    ):
        if limit is None or have + want <= limit:
            continue
        over.append(f"{label}: {have}{unit} used + {want}{unit} requested > {limit}{unit} limit")
        permanent = permanent or want > limit
    if not over:
        return None
    return Refusal(
        ReasonCode.QUOTA_EXCEEDED,
        f"namespace {namespace} is over its GPU quota: {'; '.join(over)}",
        None,
        permanent,
    )
