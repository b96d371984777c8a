"""What a namespace holds against its quota when a ResourceClaim asks for more (DRA mode).

The ledger's active rows (pods' and mirrored claims', `usage.quota_usage`) plus the claims the
API server holds that the reconciler has not mirrored yet: without them a burst of claims
created between two reconciles would each see the same ledger and all pass
(docs/dra.md, *Quotas at admission*). The caller reads the claims from the API server (this
layer does not talk to it) and hands them in as JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.db.models import Min

from controlplane.ledger.models import Card, PodBinding
from controlplane.ledger.usage import quota_usage
from controlplane.scheduling import QuotaUsage, RequestError
from controlplane.scheduling.claim_demand import parse_claim_spec


@dataclass(frozen=True, slots=True)
class ClaimUsage:
    """A namespace's usage: in the ledger, and of claims the ledger has not mirrored yet."""

    ledger: QuotaUsage
    unmirrored: QuotaUsage
    unmirrored_claims: int

    @property
    def total(self) -> QuotaUsage:
        return self.ledger + self.unmirrored


def smallest_card_mib() -> int:
    """The smallest present card's memory (0 with none): what a claim that names no memory (the
    request policy's default, the whole card) takes at least (one query)."""
    found = Card.objects.filter(present=True).aggregate(mib=Min("memory_mib"))["mib"]
    return int(found or 0)


def namespace_claim_usage(
    namespace: str, api_claims: Iterable[Mapping[str, Any]], whole_card_mib: int
) -> ClaimUsage:
    """The namespace's ledger usage plus the demand of its claims in ``api_claims`` (the API
    server's list) that hold no active ledger row. A claim being deleted is left out, as is one
    whose spec names no Tessera class; one whose spec cannot be read counts nothing (the API
    server stored it, so only a class Tessera does not know can make it unreadable here).
    Three queries."""
    pending: dict[str, QuotaUsage] = {}
    for claim in api_claims:
        meta = claim.get("metadata") or {}
        uid = meta.get("uid")
        if (
            not uid
            or meta.get("namespace", namespace) != namespace
            or meta.get("deletionTimestamp")
        ):
            continue
        try:
            ask = parse_claim_spec(claim.get("spec"))
        except RequestError:
            continue
        if ask.tessera:
            pending[str(uid)] = ask.demand(whole_card_mib)
    mirrored = set(
        PodBinding.objects.filter(
            pod_uid__in=list(pending), phase__in=PodBinding.ACTIVE_PHASES
        ).values_list("pod_uid", flat=True)
    )
    unmirrored = QuotaUsage()
    count = 0
    for uid, demand in pending.items():
        if uid not in mirrored:
            unmirrored = unmirrored + demand
            count += 1
    return ClaimUsage(quota_usage(namespace), unmirrored, count)
