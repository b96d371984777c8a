"""Pod bindings: the allocation itself (`bind_pod`), and every later change of a binding.

`bind_pod` is bind's authoritative step, lock -> recompute -> write -> commit in one function:
lock the namespace's quota row and the node's row, re-run the scheduling core on the committed
cards and slices read under those locks, write the binding and its slices, commit. It returns a
frozen `Reservation`. The extender then creates the Binding through the API server and, once it
is accepted, queues the confirmation (reserved -> bound, `confirmations`).

A binding's life: reserved (room held, the Binding not yet accepted) -> bound (the API server
accepted it) -> allocated (the node plugin handed the container its cards) -> released (the pod
ended), or failed (the Binding was refused, or never made it). A pod UID is bound once: an
ended pod's UID is refused, a failed attempt's row is reused by the retry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.ledger import allocation, selectors, sql, usage
from controlplane.ledger.errors import (
    AllocationRefused,
    AlreadyPlaced,
    Conflict,
    NotFound,
)
from controlplane.ledger.models import Card, Node, Nomination, PodBinding, Slice
from controlplane.ledger.services import modes
from controlplane.ledger.services.audit import record_event, record_events
from controlplane.scheduling import (
    Assignment,
    CardClaim,
    NodeFit,
    PodRequest,
    check_quota,
    claims_per_card,
    place_on_node,
    usage_of,
)

Phase = PodBinding.Phase


@dataclass(frozen=True, slots=True)
class Reservation:
    """What `bind_pod` holds for a pod: its binding row, its phase and the core's assignments.

    `repeat` is True when the pod already held this binding (a retried bind): nothing was
    written. `send_binding` says whether the Binding is still to go through the API server:
    always for a new reservation, for a repeat only while it is `reserved` (one past it was
    accepted already and needs no second Binding). `card_indexes` gives each assigned card's
    index on the node (the order the container sees its cards in).
    """

    binding_id: int
    pod_uid: str
    namespace: str
    name: str
    node: str
    phase: str
    assignments: tuple[Assignment, ...]
    card_indexes: Mapping[str, int]
    repeat: bool
    send_binding: bool

    def claims(self) -> dict[str, CardClaim]:
        """The room the pod takes on each card (init containers at their peak)."""
        return claims_per_card(a.to_claim() for a in self.assignments)

    def containers(self) -> list[allocation.ContainerAllocation]:
        """Per container, the slices it holds."""
        indexes = self.card_indexes
        rows = (
            allocation.SliceRow(
                a.container_name, a.container_index, a.init, a.card_uuid, indexes[a.card_uuid],
                a.memory_mib, a.cores, a.sidecar, a.priority, a.mode, a.mig_profile, a.mig_start,
                a.mig_size, a.resident_mib,
            )
            for a in self.assignments
        )  # fmt: skip
        return allocation.containers_of(rows)

    def allocation(self) -> dict[str, Any]:
        """The signed record's content (docs/allocation.md)."""
        return allocation.allocation_record(
            self.pod_uid, self.namespace, self.name, self.node, self.containers()
        )


@dataclass(frozen=True, slots=True)
class BindingPhase:
    """A binding after a change of its phase (a confirmation, a release, a node plugin's report,
    an adoption): whose it is, where, the phase it is in and when it moved."""

    binding_id: int
    pod_uid: str
    namespace: str
    name: str
    node: str  # blank when the node has left the ledger
    phase: str
    reason: str
    bound_at: datetime | None
    released_at: datetime | None

    @classmethod
    def of(cls, binding: PodBinding) -> BindingPhase:
        node = binding.node.name if binding.node_id is not None else ""
        return cls(
            binding.pk, binding.pod_uid, binding.namespace, binding.name, node,
            str(binding.phase), binding.reason, binding.bound_at, binding.released_at,
        )  # fmt: skip


def bind_pod(request: PodRequest, node_name: str) -> Reservation:
    """Reserve room for the pod on the node: lock -> recompute -> write -> commit.

    Idempotent per pod UID: a pod that already holds an active binding on this node gets it
    back (`repeat`); on another node it is AlreadyPlaced. Raises AllocationRefused when the
    room is gone or the namespace quota would be exceeded, NotFound for an unknown node,
    Conflict for a pod that has ended.
    """
    try:
        with transaction.atomic(durable=True):
            # Lock: the namespace's quota row, then the node's row; then read the node's cards,
            # their active slices and the pod's binding, after both locks are held, so a twin
            # bind of the same pod that waited for the lock sees the reservation just made.
            locked = sql.lock_and_read(request.namespace, node_name, request.uid)
            if locked.node is None:
                _placed_elsewhere(request.uid, node_name)
                raise NotFound(f"node {node_name!r} is not registered with Tessera", field="node")
            earlier = None
            if locked.binding_id is not None:
                earlier = (
                    PodBinding.objects.select_for_update(of=("self",))
                    .select_related("node")
                    .get(pk=locked.binding_id)
                )
                if earlier.active:
                    if (
                        earlier.phase == Phase.RESERVED
                        and earlier.node
                        and earlier.node.name == node_name
                    ):
                        # A retried bind sends the Binding again: its reservation lives a full
                        # timeout from now, so a reconciler that saw the pod unbound before
                        # this Binding cannot take the reservation for one that never came.
                        earlier.deadline = timezone.now() + timedelta(
                            seconds=settings.TESSERA["RESERVATION_TIMEOUT_S"]
                        )
                        earlier.save(update_fields=["deadline"])
                    return _repeat(earlier, node_name)
                if earlier.phase == Phase.RELEASED:
                    raise Conflict(
                        f"pod {request.namespace}/{request.name} ({request.uid}) has ended; a "
                        "pod UID is never bound twice",
                        field="pod_uid",
                    )

            # Recompute: the core on the committed rows read under the locks.
            state, card_ids = selectors.node_state(locked.node, locked.cards, locked.slices)
            # Room held for a preemption under way is taken, except the pod's own.
            state = selectors.holding(state, locked.held, request.uid)
            placed = place_on_node(state, request)
            if isinstance(placed, NodeFit):
                raise AllocationRefused(
                    f"pod {request.namespace}/{request.name} no longer fits on {node_name}: "
                    f"{placed.summary()}",
                    placed.refusals,
                )
            if locked.quota is not None:
                demand = usage_of(claims_per_card(a.to_claim() for a in placed))
                held = usage.quota_usage(request.namespace)
                refusal = check_quota(request.namespace, locked.quota, held, demand)
                if refusal is not None:
                    raise AllocationRefused(refusal.message, (refusal,))

            # Write: the binding and its slices (a failed earlier attempt's row is reused: the
            # pod UID is unique). The commit is the end of this block.
            now = timezone.now()
            deadline = now + timedelta(seconds=settings.TESSERA["RESERVATION_TIMEOUT_S"])
            slices = _slice_rows(placed, card_ids)
            if earlier is None:
                binding_id = sql.insert_binding(
                    {
                        "pod_uid": request.uid,
                        "namespace": request.namespace,
                        "name": request.name,
                        "node": locked.node.pk,
                        "phase": Phase.RESERVED.value,
                        "reason": "",
                        "request": request.to_dict(),
                        "deadline": deadline,
                        "reserved_at": now,
                        "created_at": now,
                        "updated_at": now,
                    },
                    slices,
                )
            else:
                binding_id = earlier.pk
                earlier.node_id, earlier.phase, earlier.reason = locked.node.pk, Phase.RESERVED, ""
                earlier.request, earlier.deadline, earlier.reserved_at = (
                    request.to_dict(), deadline, now
                )  # fmt: skip
                earlier.namespace, earlier.name = request.namespace, request.name
                earlier.save()
                # The failed attempt's inactive slices would collide with the new ones on the
                # unique (binding, container, card) constraint when the retry lands on a card
                # it had.
                earlier.slices.filter(active=False).delete()
                sql.insert_slices(binding_id, slices, now)
            if any(uid == request.uid for uid, _ in locked.held):
                # The pod takes the room preemption held for it (or binds elsewhere): the hold
                # ends with this reservation.
                held = Nomination.objects.filter(pod_uid=request.uid)
                Node.objects.filter(pk__in=held.values("node_id")).update()
                held.delete()
    except IntegrityError:
        # Another replica reserved the same pod UID between our read and our insert: the
        # unique constraint stopped the second row. The one that won answers.
        winner = PodBinding.objects.select_related("node").filter(pod_uid=request.uid).first()
        if winner is None or not winner.active:
            raise
        return _repeat(winner, node_name)
    return Reservation(
        binding_id=binding_id,
        pod_uid=request.uid,
        namespace=request.namespace,
        name=request.name,
        node=node_name,
        phase=Phase.RESERVED.value,
        assignments=tuple(placed),
        card_indexes={c.uuid: c.index for c in state.cards},
        repeat=False,
        send_binding=True,
    )


def held_reservation(pod_uid: str, node_name: str) -> Reservation | None:
    """The active binding the pod holds on this node, read back as a repeat (its `send_binding`
    says whether the Binding is still to go); None when it holds none; AlreadyPlaced when it is
    held on another node. Writes nothing: for a bind whose pod the API server no longer has."""
    existing = PodBinding.objects.select_related("node").filter(pod_uid=pod_uid).first()
    if existing is None or not existing.active:
        return None
    return _repeat(existing, node_name)


def _placed_elsewhere(pod_uid: str, node_name: str) -> None:
    """For a bind to a node the ledger lacks: a pod already placed elsewhere says more."""
    held_reservation(pod_uid, node_name)


def _repeat(binding: PodBinding, node_name: str) -> Reservation:
    """The reservation a pod already holds on this node, read back; AlreadyPlaced elsewhere."""
    where = binding.node.name if binding.node else ""
    if where != node_name:
        raise AlreadyPlaced(
            f"pod {binding.namespace}/{binding.name} ({binding.pod_uid}) is already "
            f"{binding.phase} on node {where or '(none)'}, not {node_name}",
            field="pod_uid",
        )
    rows = [
        allocation.SliceRow._make(row)
        for row in Slice.objects.filter(binding_id=binding.pk, active=True)
        .order_by("init_container", "container_index", "id")
        .values_list(*allocation.SLICE_COLUMNS)
    ]
    return Reservation(
        binding_id=binding.pk,
        pod_uid=binding.pod_uid,
        namespace=binding.namespace,
        name=binding.name,
        node=where,
        phase=str(binding.phase),
        assignments=tuple(_assignment(row) for row in rows),
        card_indexes={row.card_uuid: row.card_index for row in rows},
        repeat=True,
        send_binding=binding.phase == Phase.RESERVED,
    )


def _assignment(row: allocation.SliceRow) -> Assignment:
    """An assignment read back from its slice row."""
    return Assignment(
        row.container_name, row.container_index, row.init, row.card_uuid, row.memory_mib,
        row.cores, row.sidecar, row.priority, row.mode, row.mig_profile, row.mig_start or 0,
        row.mig_size or 0, row.resident_mib,
    )  # fmt: skip


def _slice_rows(
    assignments: Iterable[Assignment], card_ids: Mapping[str, int]
) -> list[sql.NewSlice]:
    # a slice that is no MIG instance leaves the placement NULL
    return [
        sql.NewSlice(card_ids[a.card_uuid], a.container_name, a.container_index, a.init,
                     a.memory_mib, a.cores, a.sidecar, a.priority, a.mig_profile,
                     a.mig_start if a.mig_size else None, a.mig_size or None, a.resident_mib)
        for a in assignments
    ]  # fmt: skip


# --- confirmations: reserved -> bound ------------------------------------------------------------


def confirm_bindings(confirmations: Sequence[tuple[str, datetime]]) -> int:
    """reserved -> bound for (pod UID, when the API server accepted its Binding) each, in one
    statement; only reservations change. The number confirmed. Bind's confirmations come here
    in batches (`confirmations`), inside the batch's transaction."""
    return sql.confirm(confirmations)


def confirm_binding(pod_uid: str) -> BindingPhase:
    """One pod's Binding is known to be accepted: reserved -> bound; repeating it changes
    nothing. Conflict when the binding has ended, NotFound when there is none."""
    sql.confirm([(pod_uid, timezone.now())])
    binding = PodBinding.objects.select_related("node").filter(pod_uid=pod_uid).first()
    if binding is None:
        raise NotFound(f"no binding for pod UID {pod_uid}", field="pod_uid")
    if binding.phase not in (Phase.BOUND, Phase.ALLOCATED):
        raise Conflict(
            f"binding of pod UID {pod_uid} is {binding.phase}; only a reservation can be confirmed",
            field="pod_uid",
        )
    return BindingPhase.of(binding)


@transaction.atomic(durable=True)
def confirm_reservations(pod_uids: Sequence[str], actor: str | None = None) -> list[str]:
    """The reconciler saw these pods bound: their reservations become bound. The UIDs that
    were reservations (others are left as they are); with `actor`, each is audited."""
    reserved = list(
        PodBinding.objects.select_for_update()
        .filter(pod_uid__in=list(pod_uids), phase=Phase.RESERVED)
        .values_list("pod_uid", "namespace", "name")
    )
    if reserved:
        now = timezone.now()
        PodBinding.objects.filter(pod_uid__in=[r[0] for r in reserved]).update(
            phase=Phase.BOUND, bound_at=now, deadline=None
        )
        if actor is not None:
            record_events(actor, "confirm", "binding", _audited(reserved, "the pod is bound"))
    return [uid for uid, _, _ in reserved]


def _audited(
    rows: Iterable[tuple[str, str, str]], reason: str
) -> Iterable[tuple[str, dict[str, Any]]]:
    for uid, namespace, name in rows:
        yield f"{namespace}/{name}", {"uid": uid, "reason": reason}


# --- releases ------------------------------------------------------------------------------------


def _locked_binding(pod_uid: str) -> PodBinding | None:
    """The pod's binding with its node, its row locked (not the node's) until the commit."""
    return (
        PodBinding.objects.select_for_update(of=("self",))
        .select_related("node")
        .filter(pod_uid=pod_uid)
        .first()
    )


@transaction.atomic
def release_binding(pod_uid: str, reason: str, *, failed: bool = False) -> BindingPhase | None:
    """Free a binding's slices: the pod ended (released) or its bind failed (failed).

    Idempotent: releasing an unknown or already released binding returns it unchanged (or None).
    """
    binding = _locked_binding(pod_uid)
    if binding is None:
        return None
    if not binding.active:
        return BindingPhase.of(binding)
    binding.phase = Phase.FAILED if failed else Phase.RELEASED
    binding.reason = reason[:2000]
    binding.released_at = timezone.now()
    binding.deadline = None
    binding.save(update_fields=["phase", "reason", "released_at", "deadline"])
    binding.slices.filter(active=True).update(active=False)
    modes.apply_after_release([binding.pk])
    return BindingPhase.of(binding)


@transaction.atomic(durable=True)
def release_bindings(
    pod_uids: Sequence[str],
    reason: str,
    *,
    failed: bool = False,
    actor: str | None = None,
    expired_by: datetime | None = None,
) -> list[str]:
    """`release_binding` for many pods at once (the reconciler's bulk path): the UIDs it
    actually released; unknown or already inactive ones are skipped. With `actor`, each release
    is audited (action `fail` or `release`). With `expired_by`, only reservations whose deadline
    had passed by then are released (checked under the row lock, so a bind that renewed its
    reservation meanwhile keeps it)."""
    rows = PodBinding.objects.select_for_update().filter(pod_uid__in=list(pod_uids))
    if expired_by is None:
        rows = rows.filter(phase__in=PodBinding.ACTIVE_PHASES)
    else:
        rows = rows.filter(phase=Phase.RESERVED, deadline__lte=expired_by)
    active = list(rows.values_list("pk", "pod_uid", "namespace", "name"))
    if not active:
        return []
    ids = [pk for pk, *_ in active]
    PodBinding.objects.filter(pk__in=ids).update(
        phase=Phase.FAILED if failed else Phase.RELEASED,
        reason=reason[:2000],
        released_at=timezone.now(),
        deadline=None,
    )
    Slice.objects.filter(binding_id__in=ids, active=True).update(active=False)
    modes.apply_after_release(ids)
    if actor is not None:
        events = _audited((row[1:] for row in active), reason)
        record_events(actor, "fail" if failed else "release", "binding", events)
    return [uid for _, uid, _, _ in active]


# --- what the node plugin reports -----------------------------------------------------------------


@transaction.atomic(durable=True)
def mark_allocated(
    pod_uid: str, container_name: str, devices: Sequence[str], actor: str, node: str | None
) -> BindingPhase:
    """A node plugin reports that a container really got `devices`: the binding becomes
    `allocated`. `node` (for node identities) must be the binding's node. Repeating it with the
    same devices changes nothing; different devices are a Conflict and change nothing."""
    binding = _locked_binding(pod_uid)
    if binding is None:
        raise NotFound(f"no binding for pod UID {pod_uid}", field="pod_uid")
    node_name = binding.node.name if binding.node else None
    if node is not None and node_name != node:
        raise NotFound(f"no binding for pod UID {pod_uid} on node {node}", field="pod_uid")
    if not binding.active:
        raise Conflict(
            f"binding of pod {binding.namespace}/{binding.name} is {binding.phase}; nothing to "
            "allocate",
            field="pod_uid",
        )
    ledger = sorted(
        binding.slices.filter(container_name=container_name, active=True).values_list(
            "card__uuid", flat=True
        )
    )
    if not ledger:
        raise NotFound(
            f"container {container_name!r} of pod {binding.namespace}/{binding.name} holds no "
            "GPU slices",
            field="container_name",
        )
    if sorted(devices) != ledger:
        raise Conflict(
            f"container {container_name!r} was allocated {', '.join(ledger)} by the ledger, not "
            f"{', '.join(sorted(devices)) or 'nothing'}; hand the container exactly those cards",
            field="devices",
        )
    if binding.phase != Phase.ALLOCATED:
        now = timezone.now()
        # A reservation here means the Binding went through (the kubelet has the pod) but the
        # extender has not confirmed yet: the node's word settles it.
        binding.bound_at = binding.bound_at or now
        binding.phase = Phase.ALLOCATED
        binding.allocated_at, binding.deadline = now, None
        binding.save(update_fields=["phase", "bound_at", "allocated_at", "deadline"])
        record_event(
            actor, "allocated", "binding", pod_uid, container=container_name, devices=ledger
        )
    return BindingPhase.of(binding)


# --- adopting what the ledger lacks -------------------------------------------------------------


@transaction.atomic(durable=True)
def adopt_binding(record: allocation.Allocation, actor: str) -> BindingPhase:
    """Record a running pod's signed allocation that the ledger lacks (e.g. a restored database).

    The pod already runs on those cards, so this records the fact even when the card is now
    over-committed (and says so in the audit log) rather than pretending it is not there.
    """
    node = Node.objects.select_for_update().filter(name=record.node).first()
    if node is None:
        raise NotFound(f"node {record.node!r} is not registered", field="node")
    uuids = {d.uuid for c in record.containers for d in c.devices}
    cards = {c.uuid: c for c in Card.objects.filter(node=node, uuid__in=uuids)}
    if len(cards) != len(uuids):
        missing = sorted(uuids - set(cards))
        raise NotFound(f"cards {', '.join(missing)} are not on node {node.name}")
    existing = PodBinding.objects.select_related("node").filter(pod_uid=record.pod_uid).first()
    if existing is not None:
        return BindingPhase.of(existing)  # adopted meanwhile
    now = timezone.now()
    binding = PodBinding.objects.create(
        pod_uid=record.pod_uid,
        namespace=record.namespace,
        name=record.name,
        node=node,
        phase=Phase.BOUND,
        reason="adopted from the pod's allocation",
        request={"adopted": True},
        reserved_at=now,
        bound_at=now,
    )
    assignments = [
        Assignment(c.name, c.index, c.init, d.uuid, d.memory_mib, d.cores, c.sidecar, c.priority,
                   d.mode, *(d.mig or ("", 0, 0)), d.resident_mib)
        for c in record.containers
        for d in c.devices
    ]  # fmt: skip
    sql.insert_slices(
        binding.pk, _slice_rows(assignments, {u: c.pk for u, c in cards.items()}), now
    )
    over = [
        card.uuid
        for card in selectors.node_cards([node.name])
        if card.uuid in uuids
        and (card.used_memory_mib > card.memory_mib or card.used_slots > card.slots)
    ]
    record_event(
        actor,
        "adopt",
        "pod",
        f"{record.namespace}/{record.name}",
        uid=record.pod_uid,
        node=node.name,
        overcommitted_cards=over,
    )
    return BindingPhase.of(binding)
