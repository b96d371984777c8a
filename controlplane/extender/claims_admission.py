"""The validating admission webhook of DRA mode: Tessera's namespace quotas on claims.

Two objects are judged at CREATE (docs/dra.md, *Quotas at admission*):

- a ResourceClaim whose requests name Tessera's device classes: what it asks
  (`claim_demand`) on top of what its namespace holds;
- a pod whose ``spec.resourceClaims`` name ResourceClaimTemplates: the claims the claim
  controller will make from them. A claim the pod names by ``resourceClaimName`` exists already
  and was judged (and counted) when it was created.

What the namespace holds is the ledger's active rows, pod and claim rows alike, plus the
namespace's claims the API server has that the reconciler has not mirrored yet
(`ledger.claim_quota`). The refusal is the extender's own quota refusal (`check_quota`), so it
reads the same in both modes. A bad claim spec is refused with its field, as a bad pod is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controlplane.extender.webhook import Admission
from controlplane.kube.base import Kube
from controlplane.ledger import selectors
from controlplane.ledger.claim_quota import namespace_claim_usage, smallest_card_mib
from controlplane.scheduling import QuotaUsage, RequestError, check_quota
from controlplane.scheduling.claim_demand import ClaimAsk, parse_claim_spec, parse_template_spec


def review_claim(claim: Mapping[str, Any], namespace: str, kube: Kube) -> Admission:
    """Allow, or deny naming the quota, a ResourceClaim being created in ``namespace``."""
    try:
        ask = parse_claim_spec(claim.get("spec"))
    except RequestError as exc:
        return Admission(False, str(exc))
    return _judge(namespace, ask, "this claim", kube)


def review_pod_claims(pod: Mapping[str, Any], namespace: str, kube: Kube) -> Admission:
    """Allow, or deny naming the quota, a pod whose claim templates would exceed it."""
    spec = pod.get("spec")
    claims = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
    if not isinstance(claims, list):
        return Admission(True)
    asks: list[ClaimAsk] = []
    names: list[str] = []
    for i, entry in enumerate(claims):
        template = entry.get("resourceClaimTemplateName") if isinstance(entry, Mapping) else None
        if not template:
            continue
        found = kube.get_claim_template(namespace, str(template))
        if found is None:
            # The claim controller makes no claim from it; the pod waits, and the scheduler
            # says why. Nothing Tessera counts is asked.
            continue
        try:
            ask = parse_template_spec(found.get("spec"))
        except RequestError as exc:
            return Admission(
                False,
                f"spec.resourceClaims[{i}]: ResourceClaimTemplate {template}: {exc}",
            )
        if ask.tessera:
            asks.append(ask)
            names.append(str(template))
    if not asks:
        return Admission(True)
    merged = ClaimAsk(tuple(r for a in asks for r in a.requests))
    what = "the claims of ResourceClaimTemplate " + ", ".join(names)
    return _judge(namespace, merged, what, kube)


def _judge(namespace: str, ask: ClaimAsk, what: str, kube: Kube) -> Admission:
    if not ask.tessera:
        return Admission(True)
    limits = selectors.quota_limits(namespace)
    if limits is None:
        return Admission(True)
    whole_card = smallest_card_mib()
    demand = ask.demand(whole_card)
    if demand == QuotaUsage():
        return Admission(True)
    usage = namespace_claim_usage(namespace, kube.list_resource_claims(namespace), whole_card)
    refusal = check_quota(namespace, limits, usage.total, demand)
    if refusal is None:
        return Admission(True)
    pending = (
        f" (used counts {usage.unmirrored_claims} claim(s) not yet in Tessera's ledger)"
        if usage.unmirrored_claims
        else ""
    )
    return Admission(False, f"{refusal.message}; requested by {what}{pending}")
