"""The scheduling decision log: each pod's latest filter outcome, the answer to "why pending?".

Diagnostics, not allocation state: the extender writes it off the filter's path in batches
(`controlplane.extender.decisions`), commits it without waiting for the WAL flush, and may lose
its last moments to a crash (the next filter writes them again). Nothing that decides an
allocation is read from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from controlplane.ledger import sql
from controlplane.ledger.models import SchedulingDecision

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
    the WAL flush at commit. A crash may lose the log's last few hundred milliseconds, never
    corrupt it, and never touches allocation rows."""
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


@transaction.atomic(durable=True)
def record_decisions(records: Sequence[DecisionRecord], bound: Sequence[str] = ()) -> None:
    """Keep each pod's latest filter outcome, bounded: at most DECISION_LOG_MAX_NODES node names
    and reasons (the counts per reason code always cover every node); the last record of a pod
    wins. `bound`: pods bind placed since, whose rows, where earlier filters wrote one, now say
    `bound`. One transaction, a statement for each."""
    if not records and not bound:
        return
    _diagnostic_commit()
    if records:
        latest = {r.pod_uid[:64]: r for r in records}
        # Hand-written (ledger/sql.py): the filter writes one row per call, and the ORM's
        # upsert costs ten times the statement itself.
        sql.upsert_decisions([_bounded(r) for r in latest.values()])
    if bound:
        sql.decisions_bound([uid[:64] for uid in bound], Outcome.BOUND.value)


@transaction.atomic(durable=True)
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
        record = DecisionRecord(pod_uid, namespace, name, outcome, summary, (), {}, {}, 0)
        sql.upsert_decisions([_bounded(record)])
