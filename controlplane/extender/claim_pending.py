"""Why-pending for a pod that waits on ResourceClaims (DRA mode).

Tessera keeps no scheduling decision for such a pod (kube-scheduler allocates without the
extender), so the answer is read from the API server: the scheduler's own reason (the pod's
`PodScheduled` condition, where kube-scheduler writes its FailedScheduling message), and for
each claim the pod names that is not allocated, Tessera's answer over the published
ResourceSlices (`ledger.claim_why`). The REST API's why and the dashboard's pod page ask here
when the ledger has no record of the pod.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.kube import adapter
from controlplane.kube.base import Kube, KubeError
from controlplane.ledger.claim_quota import smallest_card_mib
from controlplane.ledger.claim_why import ClaimAnswer, answer_claim, card_rooms
from controlplane.scheduling.claim_demand import DRIVER

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PodClaimsStatus:
    """Where a claim-waiting pod stands: `outcome` for machines, `text` for people."""

    namespace: str
    name: str
    pod_uid: str
    outcome: str  # bound | unschedulable | pending
    node: str | None
    scheduler_reason: str
    claims: tuple[ClaimAnswer, ...]

    @property
    def text(self) -> str:
        if self.node:
            return f"Not pending: the pod is bound on node {self.node}, its claims allocated."
        reason = self.scheduler_reason or "kube-scheduler has not reported on it yet"
        parts = [f"Pending. The scheduler says: {reason}"]
        parts += [c.text for c in self.claims]
        return " ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "scheduler_reason": self.scheduler_reason or None,
            "claims": [c.as_dict() for c in self.claims],
        }


def pod_claims_status(namespace: str, name: str, kube: Kube) -> PodClaimsStatus | None:
    """The answer for the pod namespace/name, or None when it does not exist or names no
    claim. Raises KubeError when the API server cannot be read."""
    pod = kube.get_pod(namespace, name)
    spec = (pod or {}).get("spec") or {}
    entries = [e for e in spec.get("resourceClaims") or [] if isinstance(e, Mapping)]
    if pod is None or not entries:
        return None
    status = pod.get("status") or {}
    node = spec.get("nodeName") or None
    reason = _scheduler_reason(status)
    uid = str((pod.get("metadata") or {}).get("uid") or "")
    if node:
        return PodClaimsStatus(namespace, name, uid, "bound", node, reason, ())
    generated = {
        s.get("name"): s.get("resourceClaimName")
        for s in status.get("resourceClaimStatuses") or []
        if isinstance(s, Mapping)
    }
    namespace_claims = kube.list_resource_claims(namespace)
    by_name = {(c.get("metadata") or {}).get("name"): c for c in namespace_claims}
    rooms = None
    whole_card = smallest_card_mib()
    answers = []
    for entry in entries:
        claim_name = entry.get("resourceClaimName") or generated.get(entry.get("name"))
        template = entry.get("resourceClaimTemplateName")
        if not claim_name:
            answers.append(ClaimAnswer(
                str(entry.get("name")), False, (), "",
                f"the claim controller has not made its claim from ResourceClaimTemplate "
                f"{template} yet (kubectl describe pod shows why)",
            ))  # fmt: skip
            continue
        claim = by_name.get(claim_name)
        if claim is None:
            answers.append(ClaimAnswer(str(claim_name), False, (), "", "does not exist"))
            continue
        if rooms is None:
            rooms = card_rooms(kube.list_resource_slices(DRIVER), kube.list_resource_claims())
        answers.append(answer_claim(claim, rooms, namespace_claims, whole_card))
    outcome = "unschedulable" if reason else "pending"
    return PodClaimsStatus(namespace, name, uid, outcome, None, reason, tuple(answers))


def pod_claims_status_or_none(namespace: str, name: str) -> tuple[PodClaimsStatus | None, str]:
    """As `pod_claims_status` with this process's adapter, and what kept it from asking: in
    extender mode the web replicas hold no API server credentials, and an API server away for
    a moment must not turn a page or the REST API's answer into an error. Logged."""
    try:
        kube = adapter.get_kube()
    except Exception as exc:  # no credentials here (extender mode): nothing to ask
        log.info("why-pending of %s/%s: no API server to ask: %s", namespace, name, exc)
        return None, f"no API server to ask ({type(exc).__name__})"
    try:
        return pod_claims_status(namespace, name, kube), ""
    except KubeError as exc:
        log.warning("why-pending of %s/%s: %s", namespace, name, exc.message)
        return None, exc.message


def _scheduler_reason(status: Mapping[str, Any]) -> str:
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            message = str(condition.get("message") or "").strip()
            return message or str(condition.get("reason") or "")
    return ""
