"""Writes of the extender: the scheduling decision log and the node plugins' confirmations.

Reservations themselves go through `controlplane.ledger.services` (lock -> recompute -> commit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from controlplane.ledger import sql as ledger_sql
from controlplane.ledger.models import PodBinding, SchedulingDecision
from controlplane.ledger.services import Conflict, NotFound, record_event

Outcome = SchedulingDecision.Outcome


@dataclass(frozen=True, slots=True)
class DecisionRecord:
    """One filter outcome, before bounding."""

    pod_uid: str
    namespace: str
    name: str
    outcome: str
    summary: str
    feasible_nodes: Sequence[str]
    node_reasons: Mapping[str, str]
    reason_counts: Mapping[str, int]
    nodes_considered: int


def _diagnostic_commit() -> None:
    """Inside a transaction that writes only the decision log: on PostgreSQL, do not wait for
    the WAL flush at commit. The log is diagnostics on the filter's hot path; a crash may lose
    its last few hundred milliseconds, never corrupt it, and never touches allocation rows."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL synchronous_commit TO OFF")


def _bounded(record: DecisionRecord) -> dict[str, object]:
    cap = int(settings.TESSERA["DECISION_LOG_MAX_NODES"])
    return {
        "pod_uid": record.pod_uid[:64],
        "namespace": record.namespace[:63],
        "name": record.name[:253],
        "outcome": record.outcome,
        "summary": record.summary[:4000],
        "feasible_nodes": list(record.feasible_nodes[:cap]),
        "node_reasons": dict(list(record.node_reasons.items())[:cap]),
        "reason_counts": dict(record.reason_counts),
        "nodes_considered": record.nodes_considered,
        "decided_at": timezone.now(),
    }


def record_decision(record: DecisionRecord) -> None:
    """Keep this pod's latest filter outcome, bounded: at most DECISION_LOG_MAX_NODES node names
    and reasons (the counts per reason code always cover every node). One upsert query."""
    record_decisions([record])


@transaction.atomic
def record_decisions(records: Sequence[DecisionRecord], bound: Sequence[str] = ()) -> None:
    """`record_decision` for many pods at once (the background writer's batches); the last
    record of a pod wins. `bound`: pods bind placed since, whose rows, where earlier filters
    wrote one, now say `bound` (most bound pods have none: their feasible decision was held
    and dropped unwritten). One transaction, a statement for each."""
    if not records and not bound:
        return
    _diagnostic_commit()
    if records:
        latest = {r.pod_uid[:64]: r for r in records}
        # Hand-written (ledger/sql.py): the filter writes one row per call, off its path but in
        # the same process, and the ORM's upsert costs ten times the statement itself.
        ledger_sql.upsert_decisions([_bounded(r) for r in latest.values()])
    if bound:
        ledger_sql.decisions_bound([uid[:64] for uid in bound], Outcome.BOUND.value)


@transaction.atomic
def record_bind_outcome(
    pod_uid: str, namespace: str, name: str, outcome: str, summary: str
) -> None:
    """Set the outcome of the pod's latest decision to what bind did, keeping the filter's
    per-node reasons (a bind refusal is the answer to "why pending?" until the next filter)."""
    _diagnostic_commit()
    updated = SchedulingDecision.objects.filter(pod_uid=pod_uid).update(
        outcome=outcome, summary=summary[:4000], decided_at=timezone.now()
    )
    if not updated:
        record_decision(DecisionRecord(pod_uid, namespace, name, outcome, summary, (), {}, {}, 0))


@transaction.atomic
def mark_allocated(
    pod_uid: str, container_name: str, devices: Sequence[str], actor: str, node: str | None
) -> PodBinding:
    """A node plugin reports that a container really got `devices`: the binding becomes
    `allocated`. `node` (for node identities) must be the binding's node. Repeating it with the
    same devices changes nothing; different devices are a Conflict and change nothing."""
    binding = (
        PodBinding.objects.select_for_update(of=("self",))
        .select_related("node")
        .filter(pod_uid=pod_uid)
        .first()
    )
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
    if binding.phase != PodBinding.Phase.ALLOCATED:
        now = timezone.now()
        # A reservation here means the Binding went through (the kubelet has the pod) but the
        # extender has not confirmed yet: the node's word settles it.
        binding.bound_at = binding.bound_at or now
        binding.phase = PodBinding.Phase.ALLOCATED
        binding.allocated_at, binding.deadline = now, None
        binding.save(update_fields=["phase", "bound_at", "allocated_at", "deadline", "updated_at"])
        record_event(
            actor, "allocated", "binding", pod_uid, container=container_name, devices=ledger
        )
    return binding
