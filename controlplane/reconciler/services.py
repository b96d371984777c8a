"""Level-based repair of the ledger against the cluster (DESIGN §1: the reconciler).

Every function compares what the ledger says with what the API server says and applies the
difference through the ledger's services (the only writers of its rows), so running it twice
changes nothing the second time. Nothing here trusts a pod's own word except an allocation the
control plane signed.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone

from controlplane.kube.sources import PodView
from controlplane.ledger import selectors
from controlplane.ledger.allocation import Allocation, InvalidAllocation
from controlplane.ledger.errors import ServiceError
from controlplane.ledger.models import PodBinding
from controlplane.ledger.services import audit, bindings

log = logging.getLogger(__name__)
SYSTEM = "reconciler"
ALLOCATION_ANNOTATION = "tessera.io/allocation"


# Verifies the signed annotations of a pod: returns the Allocation, or raises ValueError with
# the reason (`allocation.verify_allocation`; tests hand in their own).
Verifier = Callable[[Mapping[str, str]], Allocation]


def reconcile_pods(
    pods: Iterable[PodView],
    *,
    listed_at: datetime,
    complete: bool,
    verify: Verifier,
    deleted_uids: Iterable[str] = (),
    now: datetime | None = None,
) -> Counter[str]:
    """Repair the ledger against pods listed at `listed_at`.

    `complete` says the pods are every pod of the cluster (a full relist): only then does a pod's
    absence mean it is gone; otherwise only `deleted_uids` are known to be gone. Bindings
    reserved after `listed_at` are left alone: their pods may simply be newer than the list.
    """
    now = now or timezone.now()
    drift: Counter[str] = Counter()
    by_uid = {p.uid: p for p in pods}
    deleted = set(deleted_uids) - set(by_uid)
    # A claim's row is the claims' pass's (`claims.reconcile_claims`): no pod has its UID.
    candidates = PodBinding.objects.filter(
        phase__in=PodBinding.ACTIVE_PHASES, created_at__lt=listed_at, source=PodBinding.Source.POD
    )
    if not complete:  # watch events: only the pods they name (a DELETED pod is gone)
        candidates = candidates.filter(pod_uid__in=[*by_uid, *deleted])
    # Plain tuples, not model instances: a full resync reads every active binding, and most
    # need nothing; building 20,000 models costs seconds.
    rows = candidates.values_list(
        "pod_uid", "namespace", "name", "phase", "node__name", "deadline", "reserved_at"
    )
    repairs = []
    for row in rows.iterator(chunk_size=5000):
        binding = BindingRow(*row)
        action = _diagnose(binding, by_uid.get(binding.pod_uid), now, listed_at)
        if action is not None:
            repairs.append((binding.pod_uid, action))
    drift += apply_repairs(repairs, listed_at)

    known = selectors.uids_with_bindings(list(by_uid))
    for pod in by_uid.values():
        if (
            pod.uid not in known
            and pod.node_name
            and not pod.terminal
            and ALLOCATION_ANNOTATION in pod.annotations
        ):
            drift[_adopt(pod, verify)] += 1
    return drift


def apply_repairs(repairs: Iterable[tuple[str, Repair]], listed_at: datetime) -> Counter[str]:
    """Apply (binding UID, repair) each through the ledger's services; the drift repaired, by
    kind. Pods' and claims' rows go the same way.

    Repairs go in bulk, grouped by reason, a chunk per transaction: a run that dies loses at most
    one chunk, which the next (level-based) run redoes; one commit per repair would cost an fsync
    and a handful of queries each.
    """
    drift: Counter[str] = Counter()
    grouped: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for uid, repair in repairs:
        grouped[(repair.kind, repair.verb, repair.reason)].append(uid)
    for (kind, verb, reason), group in grouped.items():
        actor = None if kind == ROUTINE else SYSTEM  # routine repairs are not audited
        for start in range(0, len(group), REPAIR_CHUNK):
            chunk = group[start : start + REPAIR_CHUNK]
            if verb == "confirm":
                done = bindings.confirm_reservations(chunk, actor)
            elif verb == "expire":
                # Only reservations still past their deadline as of the pods' view: a retried
                # bind since then sent its Binding again and moved the deadline.
                done = bindings.release_bindings(
                    chunk, reason, failed=True, actor=actor, expired_by=listed_at
                )
            else:
                done = bindings.release_bindings(chunk, reason, failed=verb == "fail", actor=actor)
            if kind != ROUTINE:
                drift[kind] += len(done)
    return drift


REPAIR_CHUNK = 500


@dataclass(frozen=True, slots=True)
class BindingRow:
    pod_uid: str
    namespace: str
    name: str
    phase: str
    node_name: str | None
    deadline: datetime | None
    reserved_at: datetime | None


# A reservation whose pod is bound and that is younger than this has its extender's own
# confirmation on the way (bind queues it, and it is written in batches moments after the
# Binding, ledger/services/confirmations.py): the reconciler may get there first, and confirms
# it as routine, not as drift. Older, its confirmation was lost (the extender's process died).
CONFIRM_GRACE = timedelta(seconds=3)


ROUTINE = ""  # a Repair's kind for what is no drift: not counted, not audited


@dataclass(frozen=True, slots=True)
class Repair:
    kind: str  # the drift counter's key (ROUTINE: none)
    verb: str  # release | fail | expire (fail a reservation still expired) | confirm
    reason: str


def _diagnose(
    binding: BindingRow, pod: PodView | None, now: datetime, listed_at: datetime
) -> Repair | None:
    """What one binding needs, given the pod as the API server had it at `listed_at` (None =
    gone)."""
    if pod is None:
        return Repair("released_deleted", "release", "the pod no longer exists")
    if pod.terminal:
        return Repair("released_finished", "release", f"the pod {pod.phase.lower()}")
    if pod.node_name and pod.node_name != binding.node_name:
        return Repair(
            "released_wrong_node",
            "fail",
            f"the pod runs on {pod.node_name}, not {binding.node_name}",
        )
    if binding.phase == PodBinding.Phase.RESERVED:
        expired = binding.deadline is not None and binding.deadline <= now
        if pod.node_name == binding.node_name:
            if not expired and binding.reserved_at and binding.reserved_at > now - CONFIRM_GRACE:
                return Repair(ROUTINE, "confirm", "the pod is bound")
            # The Binding reached the API server but its process died before confirming.
            return Repair("confirmed_reservation", "confirm", "the pod is bound")
        # Unbound in a view taken after the deadline: the Binding never came. (Expired only
        # after the view, the pod may have been bound since: the next pass looks again.)
        if binding.deadline is not None and binding.deadline <= listed_at:
            return Repair(
                "released_expired_reservation",
                "expire",
                "the reservation expired: its Binding never reached the API server",
            )
    return None


def _adopt(pod: PodView, verify: Verifier) -> str:
    try:
        allocation = verify(pod.annotations)
        if (allocation.pod_uid, allocation.namespace, allocation.name, allocation.node) != (
            pod.uid,
            pod.namespace,
            pod.name,
            pod.node_name,
        ):
            raise InvalidAllocation("the allocation names another pod or node")
    except ValueError as exc:
        audit.record_event(
            SYSTEM,
            "invalid-allocation",
            "pod",
            f"{pod.namespace}/{pod.name}",
            uid=pod.uid,
            reason=str(exc),
        )
        log.warning("pod %s/%s carries an invalid allocation: %s", pod.namespace, pod.name, exc)
        return "flagged_invalid_allocation"
    try:
        bindings.adopt_binding(allocation, SYSTEM)
    except ServiceError as exc:
        audit.record_event(
            SYSTEM,
            "adopt-failed",
            "pod",
            f"{pod.namespace}/{pod.name}",
            uid=pod.uid,
            reason=exc.message,
        )
        return "flagged_adopt_failed"
    return "adopted"
