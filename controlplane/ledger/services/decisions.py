"""The scheduling decision log: each pod's latest filter outcome, the answer to "why pending?".

Diagnostics, not allocation state: the extender writes it off the filter's path in batches
(`controlplane.extender.decision_writer`), commits it without waiting for the WAL flush, and may
lose its last moments to a crash (the next filter writes them again). Nothing that decides an
allocation is read from it.

Bounded: an entry lives until its pod is bound or gone, or for DECISION_RETENTION_S at most
(`prune_decisions` from the reconciler's prune task, `forget_decisions` from its passes).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from controlplane.ledger import sql
from controlplane.ledger.models import PodBinding, SchedulingDecision

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


# Rows per DELETE statement (and per transaction): short locks, and far under SQLite's limit on
# the parameters of one statement.
DELETE_CHUNK = 1000


def prune_decisions(*, now: datetime | None = None, limit: int | None = None) -> int:
    """Delete the decision log's entries that answer nothing any more, oldest first, at most
    `limit` (PRUNE_BATCH) of them; the number deleted.

    - older than DECISION_RETENTION_S: a pod still pending is filtered again within minutes and
      its entry rewritten, so an older one belongs to a pod the scheduler stopped asking about;
    - of pods whose binding is bound, allocated or released: "why pending?" is answered by the
      binding from then on (a failed bind keeps its entry: the pod will be tried again).
    """
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=settings.TESSERA["DECISION_RETENTION_S"])
    limit = limit or int(settings.TESSERA["PRUNE_BATCH"])
    settled = PodBinding.objects.filter(
        pod_uid=OuterRef("pod_uid"),
        phase__in=(PodBinding.Phase.BOUND, PodBinding.Phase.ALLOCATED, PodBinding.Phase.RELEASED),
    )
    ids = list(
        SchedulingDecision.objects.filter(Q(decided_at__lt=cutoff) | Q(Exists(settled)))
        .order_by("decided_at", "id")
        .values_list("id", flat=True)[:limit]
    )
    return sum(
        _delete_decisions(Q(id__in=ids[start : start + DELETE_CHUNK]))
        for start in range(0, len(ids), DELETE_CHUNK)
    )


def forget_decisions(pod_uids: Collection[str], *, before: datetime) -> int:
    """Delete the entries of pods the cluster no longer has (a full list without them, or their
    deletion events), decided before `before`: the time the list was taken, since a pod created
    after it is rightly absent from it. Without this a pod deleted while pending would count as
    pending on the dashboard until its entry aged out. At most PRUNE_BATCH; the number deleted.
    """
    uids = sorted({uid[:64] for uid in pod_uids})[: int(settings.TESSERA["PRUNE_BATCH"])]
    return sum(
        _delete_decisions(Q(pod_uid__in=uids[start : start + DELETE_CHUNK], decided_at__lt=before))
        for start in range(0, len(uids), DELETE_CHUNK)
    )


@transaction.atomic(durable=True)
def _delete_decisions(which: Q) -> int:
    _diagnostic_commit()
    deleted, _ = SchedulingDecision.objects.filter(which).delete()
    return deleted


def note_preemption(pod_uid: str, namespace: str, name: str, text: str) -> None:
    """Record what preemption did for the pod on its decision row (the filter's rewrites of the
    row keep it). The filter's own decision may not be written yet (it is, off the filter's
    path): then the row starts here, and the filter's write fills in the rest."""
    text = text[:2000]
    if SchedulingDecision.objects.filter(pod_uid=pod_uid).update(preemption=text):
        return
    try:
        with transaction.atomic():
            SchedulingDecision.objects.create(
                pod_uid=pod_uid, namespace=namespace, name=name, outcome=Outcome.UNSCHEDULABLE,
                summary="", decided_at=timezone.now(), preemption=text,
            )  # fmt: skip
    except IntegrityError:  # the filter's write came first after all
        SchedulingDecision.objects.filter(pod_uid=pod_uid).update(preemption=text)
