"""Level-based repair of the ledger against the cluster (DESIGN §1: the reconciler).

Every function compares what the ledger says with what the API server says and applies the
difference through the ledger services, so running it twice changes nothing the second time.
Nothing here trusts a pod's own word except an allocation the control plane signed.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.kube.sources import PodView
from controlplane.ledger import services as ledger
from controlplane.ledger.models import AuditEvent, Card, Node, PodBinding
from controlplane.ledger.selectors import cluster_snapshot
from controlplane.scheduling import Assignment

log = logging.getLogger(__name__)
SYSTEM = "reconciler"
ALLOCATION_ANNOTATION = "tessera.io/allocation"


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    uuid: str
    memory_mib: int
    cores: int


@dataclass(frozen=True, slots=True)
class AllocatedContainer:
    name: str
    index: int
    init: bool
    devices: tuple[AllocatedDevice, ...]


@dataclass(frozen=True, slots=True)
class Allocation:
    """A verified allocation record (docs/allocation.md)."""

    pod_uid: str
    namespace: str
    name: str
    node: str
    containers: tuple[AllocatedContainer, ...]


# Verifies the signed annotations of a pod: returns the Allocation, or raises ValueError with the
# reason. The extender owns the signing key and format; `default_verifier` binds to it.
Verifier = Callable[[Mapping[str, str]], Allocation]


class InvalidAllocation(ValueError):
    pass


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
    candidates = PodBinding.objects.filter(
        phase__in=PodBinding.ACTIVE_PHASES, created_at__lt=listed_at
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
        action = _diagnose(binding, by_uid.get(binding.pod_uid), now)
        if action is not None:
            repairs.append((binding, action))
    # Releases go in bulk, grouped by reason, a chunk per transaction: a run that dies loses at
    # most one chunk, which the next (level-based) run redoes; one commit per repair would cost
    # an fsync and a handful of queries each.
    grouped: dict[tuple[str, str, str], list[BindingRow]] = defaultdict(list)
    for binding, repair in repairs:
        grouped[(repair.kind, repair.verb, repair.reason)].append(binding)
    for (kind, verb, reason), bindings in grouped.items():
        for start in range(0, len(bindings), REPAIR_CHUNK):
            chunk = {b.pod_uid: b for b in bindings[start : start + REPAIR_CHUNK]}
            with transaction.atomic():
                if verb == "confirm":
                    done = [uid for uid in chunk if _confirmed(uid)]
                else:
                    done = ledger.release_bindings(list(chunk), reason, failed=verb == "fail")
                if kind == ROUTINE:
                    continue
                AuditEvent.objects.bulk_create(
                    AuditEvent(
                        actor=SYSTEM,
                        action=verb,
                        target_type="binding",
                        target=f"{chunk[uid].namespace}/{chunk[uid].name}"[:253],
                        details={"uid": uid, "reason": reason},
                    )
                    for uid in done
                )
            drift[kind] += len(done)

    uids = list(by_uid)
    ledger_uids: set[str] = set()
    for start in range(0, len(uids), 5000):  # bounded IN lists (SQLite caps parameters)
        ledger_uids.update(
            PodBinding.objects.filter(pod_uid__in=uids[start : start + 5000]).values_list(
                "pod_uid", flat=True
            )
        )
    for pod in by_uid.values():
        if (
            pod.uid not in ledger_uids
            and pod.node_name
            and not pod.terminal
            and ALLOCATION_ANNOTATION in pod.annotations
        ):
            drift[_adopt(pod, verify)] += 1
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
# confirmation on the way (the extender confirms in batches moments after the Binding,
# extender/decisions.py): the reconciler may get there first, and confirms it as routine, not
# as drift. Older, its confirmation was lost (the extender's process died).
CONFIRM_GRACE = timedelta(seconds=3)


ROUTINE = ""  # a Repair's kind for what is no drift: not counted, not audited


@dataclass(frozen=True, slots=True)
class Repair:
    kind: str  # the drift counter's key (ROUTINE: none)
    verb: str  # release | fail | confirm
    reason: str


def _diagnose(binding: BindingRow, pod: PodView | None, now: datetime) -> Repair | None:
    """What one binding needs, given the pod as the API server has it (None = gone)."""
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
        if expired:
            return Repair(
                "released_expired_reservation",
                "fail",
                "the reservation expired: its Binding never reached the API server",
            )
    return None


def _confirmed(pod_uid: str) -> bool:
    try:
        ledger.confirm_binding(pod_uid)  # its own savepoint: a refusal undoes only itself
    except ledger.ServiceError:  # released meanwhile: nothing left to confirm
        return False
    return True


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
        ledger.record_event(
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
        adopt_binding(allocation)
    except ledger.ServiceError as exc:
        ledger.record_event(
            SYSTEM,
            "adopt-failed",
            "pod",
            f"{pod.namespace}/{pod.name}",
            uid=pod.uid,
            reason=exc.message,
        )
        return "flagged_adopt_failed"
    return "adopted"


@transaction.atomic
def adopt_binding(allocation: Allocation) -> PodBinding:
    """Record a running pod's signed allocation that the ledger lacks (e.g. a restored database).

    The pod already runs on those cards, so this records the fact even when the card is now
    over-committed (and says so in the audit log) rather than pretending it is not there.
    """
    node = Node.objects.select_for_update().filter(name=allocation.node).first()
    if node is None:
        raise ledger.NotFound(f"node {allocation.node!r} is not registered", field="node")
    uuids = {d.uuid for c in allocation.containers for d in c.devices}
    cards = {c.uuid: c for c in Card.objects.filter(node=node, uuid__in=uuids)}
    if len(cards) != len(uuids):
        missing = sorted(uuids - set(cards))
        raise ledger.NotFound(f"cards {', '.join(missing)} are not on node {node.name}")
    if PodBinding.objects.filter(pod_uid=allocation.pod_uid).exists():
        return PodBinding.objects.get(pod_uid=allocation.pod_uid)  # adopted meanwhile
    now = timezone.now()
    binding = PodBinding.objects.create(
        pod_uid=allocation.pod_uid,
        namespace=allocation.namespace,
        name=allocation.name,
        node=node,
        phase=PodBinding.Phase.BOUND,
        reason="adopted from the pod's allocation",
        request={"adopted": True},
        reserved_at=now,
        bound_at=now,
    )
    ledger.write_slices(
        binding,
        (
            Assignment(c.name, c.index, c.init, d.uuid, d.memory_mib, d.cores)
            for c in allocation.containers
            for d in c.devices
        ),
        {uuid: card.pk for uuid, card in cards.items()},
    )
    over = _overcommitted(node.name, set(cards))
    ledger.record_event(
        SYSTEM,
        "adopt",
        "pod",
        f"{allocation.namespace}/{allocation.name}",
        uid=allocation.pod_uid,
        node=node.name,
        overcommitted_cards=over,
    )
    return binding


def _overcommitted(node_name: str, uuids: set[str]) -> list[str]:
    out = []
    for node in cluster_snapshot([node_name]).nodes:
        for card in node.cards:
            if card.uuid in uuids and (
                card.used_memory_mib > card.memory_mib or card.used_slots > card.slots
            ):
                out.append(card.uuid)
    return out


def mark_stale_nodes(now: datetime | None = None) -> int:
    """Nodes whose plugin has been silent too long are not ready: no new slices land there.

    Their next inventory report makes them ready again.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.TESSERA["NODE_STALE_AFTER_S"])
    stale = list(
        Node.objects.filter(ready=True, last_heartbeat__lt=cutoff).values_list("name", flat=True)
    )
    if stale:
        with transaction.atomic():
            Node.objects.filter(name__in=stale, ready=True).update(ready=False, updated_at=now)
            for name in stale:
                ledger.record_event(SYSTEM, "node-stale", "node", name, silent_since=str(cutoff))
    return len(stale)


def mark_deleted_nodes(cluster_nodes: set[str]) -> int:
    """Ledger nodes the API server no longer has are not ready (their bindings end with pods)."""
    gone = list(
        Node.objects.filter(ready=True)
        .exclude(name__in=cluster_nodes)
        .values_list("name", flat=True)
    )
    if gone:
        with transaction.atomic():
            Node.objects.filter(name__in=gone).update(ready=False)
            for name in gone:
                ledger.record_event(SYSTEM, "node-deleted", "node", name)
    return len(gone)
