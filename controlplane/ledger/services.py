"""Services: the only code that writes ledger rows.

Allocation is lock -> recompute -> commit: take the node's row lock, re-run the scheduling core
on committed rows inside it, write, commit. Lock order everywhere: namespace quota, then node,
so two reservations can never deadlock on each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane import rawsql
from controlplane.ledger import selectors, sql
from controlplane.ledger.models import AuditEvent, Card, Node, PodBinding, Slice
from controlplane.scheduling import (
    Assignment,
    NodeFit,
    PodRequest,
    Refusal,
    SliceClaim,
    check_quota,
    claims_per_card,
    place_on_node,
    usage_of,
)


class ServiceError(Exception):
    """A refusal a caller can act on. `field` names the input at fault, when there is one."""

    status = 400

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFound(ServiceError):
    status = 404


class Conflict(ServiceError):
    status = 409


class AlreadyPlaced(Conflict):
    """The pod already holds an active binding on another node."""


class AllocationRefused(Conflict):
    """The room is gone (or never was): carries the core's refusals."""

    def __init__(self, message: str, refusals: Sequence[Refusal]) -> None:
        super().__init__(message)
        self.refusals = tuple(refusals)


def record_event(
    actor: str, action: str, target_type: str, target: str, **details: Any
) -> AuditEvent:
    """Append an audit event (inside the caller's transaction, so it commits with the change)."""
    return AuditEvent.objects.create(
        actor=actor[:150],
        action=action,
        target_type=target_type,
        target=target[:253],
        details=details,
    )


# --- inventory -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CardReport:
    uuid: str
    index: int
    model: str
    memory_mib: int
    numa_node: int | None
    healthy: bool
    health_reason: str


@dataclass(frozen=True, slots=True)
class InventoryReport:
    plugin_version: str
    cards: tuple[CardReport, ...]


@dataclass(frozen=True, slots=True)
class InventoryResult:
    node: Node
    created: bool
    cards_added: tuple[str, ...]
    cards_missing: tuple[str, ...]


@transaction.atomic
def apply_inventory(node_name: str, report: InventoryReport, actor: str) -> InventoryResult:
    """Apply a node plugin's report: it is the node's heartbeat and its full list of cards.

    The first report creates the node. Cards missing from a report stay on record (their slices
    too, until the pods end) but take no new slices. A UUID registered to another node is
    refused: a card cannot be in two machines at once, so such a report is wrong or forged.
    """
    now = timezone.now()
    node, created = Node.objects.get_or_create(name=node_name)
    node = Node.objects.select_for_update().get(pk=node.pk)

    reported = {c.uuid: c for c in report.cards}
    locked_cards = Card.objects.select_for_update(of=("self",)).select_related("node")
    known = {c.uuid: c for c in locked_cards.filter(uuid__in=reported)}
    for position, card in enumerate(report.cards):
        owner = known.get(card.uuid)
        if owner is not None and owner.node_id != node.pk:
            raise Conflict(
                f"card {card.uuid} is registered to node {owner.node.name}; a card cannot be "
                "reported by two nodes. Remove it from that node first if it really moved.",
                field=f"cards[{position}].uuid",
            )

    added: list[str] = []
    for card in report.cards:
        row = known.get(card.uuid)
        if row is None:
            Card.objects.create(
                node=node,
                uuid=card.uuid,
                index=card.index,
                model=card.model,
                memory_mib=card.memory_mib,
                numa_node=card.numa_node,
                healthy=card.healthy,
                health_reason=card.health_reason,
                slots=settings.TESSERA["DEFAULT_SLOTS"],
                present=True,
                last_seen=now,
            )
            added.append(card.uuid)
            continue
        if row.healthy != card.healthy:
            record_event(
                actor,
                "card-health",
                "card",
                card.uuid,
                healthy=card.healthy,
                reason=card.health_reason,
            )
        if not row.present:
            record_event(actor, "card-returned", "card", card.uuid)
        row.index, row.model, row.memory_mib = card.index, card.model, card.memory_mib
        row.numa_node, row.healthy, row.health_reason = (
            card.numa_node,
            card.healthy,
            card.health_reason,
        )
        row.present, row.last_seen = True, now
        row.save(
            update_fields=[
                "index",
                "model",
                "memory_mib",
                "numa_node",
                "healthy",
                "health_reason",
                "present",
                "last_seen",
                "updated_at",
            ]
        )

    missing = list(
        Card.objects.filter(node=node, present=True)
        .exclude(uuid__in=reported)
        .values_list("uuid", flat=True)
    )
    if missing:
        Card.objects.filter(node=node, uuid__in=missing).update(present=False, updated_at=now)
        for uuid in missing:
            record_event(actor, "card-missing", "card", uuid, node=node.name)
    if created:
        record_event(actor, "node-registered", "node", node.name, cards=len(report.cards))
    elif added:
        record_event(actor, "cards-added", "node", node.name, cards=added)

    node.ready = True
    node.last_heartbeat = now
    node.plugin_version = report.plugin_version
    node.save(update_fields=["ready", "last_heartbeat", "plugin_version", "updated_at"])
    return InventoryResult(node, created, tuple(added), tuple(missing))


# --- bindings ------------------------------------------------------------------------------------


def _slice_claims(assignments: Sequence[Assignment]) -> list[SliceClaim]:
    return [
        SliceClaim(a.card_uuid, a.container_index, a.init, a.memory_mib, a.cores)
        for a in assignments
    ]


def reserve_binding(request: PodRequest, node_name: str) -> PodBinding:
    """Reserve room for a pod on a node: lock, re-fit on committed rows, write binding + slices.

    Idempotent per pod UID: a pod that already holds an active binding on this node gets it back;
    on another node it is a Conflict. Raises AllocationRefused when the room is gone or the
    namespace quota would be exceeded, NotFound for an unknown node.
    """
    try:
        with transaction.atomic():
            return _reserve(request, node_name)
    except IntegrityError:
        # Another replica reserved the same pod UID between our read and our insert: the unique
        # constraint stopped the second row; answer with the one that won.
        existing = PodBinding.objects.select_related("node").filter(pod_uid=request.uid).first()
        if existing is None or not existing.active:
            raise
        return _same_node_or_conflict(existing, node_name)


def _same_node_or_conflict(existing: PodBinding, node_name: str) -> PodBinding:
    if existing.node is not None and existing.node.name == node_name:
        return existing
    where = existing.node.name if existing.node else "(none)"
    raise AlreadyPlaced(
        f"pod {existing.namespace}/{existing.name} ({existing.pod_uid}) is already "
        f"{existing.phase} on node {where}, not {node_name}",
        field="pod_uid",
    )


def _reserve(request: PodRequest, node_name: str) -> PodBinding:
    # The hot path in hand-written SQL (ledger/sql.py says why); rare branches use the ORM.
    # Lock order: quota, then node (see module docstring).
    locked = sql.lock_and_read(request.namespace, node_name, request.uid)
    quota, node, cards, slices = locked.quota, locked.node, locked.cards, locked.slices
    if node is None:
        existing = PodBinding.objects.select_related("node").filter(pod_uid=request.uid).first()
        if existing is not None and existing.active:
            _same_node_or_conflict(existing, node_name)  # placed elsewhere says more
        raise NotFound(f"node {node_name!r} is not registered with Tessera", field="node")
    # The pod's binding was read under the node lock (with the node's cards and slices): a
    # retried bind of the same pod that waited for the lock must see the reservation its twin
    # just committed, not re-fit.
    existing, existing_id = None, locked.binding_id
    if existing_id is not None:
        existing = (
            PodBinding.objects.select_for_update(of=("self",))
            .select_related("node")
            .get(pk=existing_id)
        )
        if existing.active:
            return _same_node_or_conflict(existing, node_name)
        if existing.phase == PodBinding.Phase.RELEASED:
            raise Conflict(
                f"pod {request.namespace}/{request.name} ({request.uid}) has ended; a pod UID "
                "is never bound twice",
                field="pod_uid",
            )

    state, card_ids = selectors.node_state(node, cards, slices)
    placed = place_on_node(state, request)
    if isinstance(placed, NodeFit):
        raise AllocationRefused(
            f"pod {request.namespace}/{request.name} no longer fits on {node_name}: "
            f"{placed.summary()}",
            placed.refusals,
        )
    if quota is not None:
        demand = usage_of(claims_per_card(_slice_claims(placed)))
        refusal = check_quota(
            request.namespace,
            quota,
            selectors.namespace_usage(request.namespace),
            demand,
        )
        if refusal is not None:
            raise AllocationRefused(refusal.message, (refusal,))

    now = timezone.now()
    deadline = now + timedelta(seconds=settings.TESSERA["RESERVATION_TIMEOUT_S"])
    node_row = rawsql.loaded(
        Node(pk=node.pk, name=node.name, ready=node.ready, cordoned=node.cordoned)
    )
    if existing is not None:  # a failed earlier attempt: reuse its row (the UID is unique)
        binding = existing
        binding.node, binding.phase, binding.reason = node_row, PodBinding.Phase.RESERVED, ""
        binding.request, binding.deadline, binding.reserved_at = request.to_dict(), deadline, now
        binding.namespace, binding.name = request.namespace, request.name
        binding.save()
        # The failed attempt's inactive slices would collide with the new ones on the unique
        # (binding, container, card) constraint when the retry lands on the same card.
        binding.slices.filter(active=False).delete()
        write_slices(binding, placed, card_ids, now)
    else:
        values = {
            "pod_uid": request.uid,
            "namespace": request.namespace,
            "name": request.name,
            "node": node.pk,
            "phase": PodBinding.Phase.RESERVED.value,
            "reason": "",
            "request": request.to_dict(),
            "deadline": deadline,
            "reserved_at": now,
            "created_at": now,
            "updated_at": now,
        }
        # The reservation's last statement: its COMMIT rides in the same round trip.
        binding_id = sql.insert_binding(values, _slice_rows(placed, card_ids), commit=True)
        binding = rawsql.loaded(PodBinding(pk=binding_id, **{**values, "node": node_row}))
    # What was just written, for the caller that signs the allocation (saves it a re-read).
    card_index = {c.uuid: c.index for c in state.cards}
    binding.placed = tuple(  # type: ignore[attr-defined]
        (
            a.container_name,
            a.container_index,
            a.init,
            a.card_uuid,
            card_index[a.card_uuid],
            a.memory_mib,
            a.cores,
        )
        for a in placed
    )
    return binding


def write_slices(
    binding: PodBinding,
    assignments: Iterable[Assignment],
    card_ids: Mapping[str, int],
    now: datetime | None = None,
) -> None:
    """The binding's slices, one per (container, card) assignment (inside the caller's
    transaction and lock; one statement)."""
    sql.insert_slices(binding.pk, _slice_rows(assignments, card_ids), now or timezone.now())


def _slice_rows(
    assignments: Iterable[Assignment], card_ids: Mapping[str, int]
) -> list[tuple[Any, ...]]:
    return [
        (card_ids[a.card_uuid], a.container_name, a.container_index, a.init, a.memory_mib,
         a.cores)
        for a in assignments
    ]  # fmt: skip


def confirm_binding(pod_uid: str, reserved: PodBinding | None = None) -> PodBinding:
    """The API server accepted the Binding: reserved -> bound. Repeating it changes nothing.

    One conditional UPDATE does the transition (atomic on its own, no lock to hold): bind's hot
    path pays one statement, not a locked read-modify-write. `reserved`, the row as bind's
    reservation wrote it, is returned updated when that UPDATE changed it (no re-read).
    """
    now = timezone.now()
    if sql.confirm([(pod_uid, now)]) == 1 and reserved is not None and reserved.pod_uid == pod_uid:
        reserved.phase, reserved.bound_at, reserved.deadline = PodBinding.Phase.BOUND, now, None
        reserved.updated_at = now
        return reserved
    binding = PodBinding.objects.filter(pod_uid=pod_uid).first()
    if binding is None:
        raise NotFound(f"no binding for pod UID {pod_uid}", field="pod_uid")
    if binding.phase not in (PodBinding.Phase.BOUND, PodBinding.Phase.ALLOCATED):
        raise Conflict(
            f"binding of pod UID {pod_uid} is {binding.phase}; only a reservation can be confirmed",
            field="pod_uid",
        )
    return binding


def confirm_bindings(confirmations: Sequence[tuple[str, datetime]]) -> int:
    """`confirm_binding` for many pods in one statement: (pod UID, when the API server accepted
    the Binding) each. Only reservations change; the number confirmed."""
    return sql.confirm(confirmations)


@transaction.atomic
def release_binding(pod_uid: str, reason: str, *, failed: bool = False) -> PodBinding | None:
    """Free a binding's slices: the pod ended (released) or its bind failed (failed).

    Idempotent: releasing an unknown or already released binding returns it unchanged (or None).
    """
    binding = PodBinding.objects.select_for_update().filter(pod_uid=pod_uid).first()
    if binding is None or not binding.active:
        return binding
    binding.phase = PodBinding.Phase.FAILED if failed else PodBinding.Phase.RELEASED
    binding.reason = reason[:2000]
    binding.released_at = timezone.now()
    binding.deadline = None
    binding.save(update_fields=["phase", "reason", "released_at", "deadline", "updated_at"])
    binding.slices.filter(active=True).update(active=False)
    return binding


@transaction.atomic
def release_bindings(pod_uids: Sequence[str], reason: str, *, failed: bool = False) -> list[str]:
    """`release_binding` for many pods at once (the reconciler's bulk path): returns the UIDs it
    actually released; unknown or already inactive ones are skipped, as one by one."""
    active = list(
        PodBinding.objects.select_for_update()
        .filter(pod_uid__in=list(pod_uids), phase__in=PodBinding.ACTIVE_PHASES)
        .values_list("pk", "pod_uid")
    )
    if not active:
        return []
    ids = [pk for pk, _ in active]
    PodBinding.objects.filter(pk__in=ids).update(
        phase=PodBinding.Phase.FAILED if failed else PodBinding.Phase.RELEASED,
        reason=reason[:2000],
        released_at=timezone.now(),
        deadline=None,
        updated_at=timezone.now(),
    )
    Slice.objects.filter(binding_id__in=ids, active=True).update(active=False)
    return [uid for _, uid in active]
