"""Off the hot path: the decision log is written by one background worker per process
(`controlplane.background`).

Filter answers the scheduler first; its decision (and bind's outcome) is queued here and written
moments later, in batches, through the ledger's `decisions.record_decisions`. The log is
diagnostics for "why pending?", not allocation state (bind's confirmations have a channel of
their own that never drops an entry, `controlplane.ledger.services.confirmations`): a process
that dies loses its last few queued entries, which the next filter of those pods writes again.
The queue is bounded; when it is full an entry is dropped (and counted), never the scheduler kept
waiting.

A feasible decision is held back for `HOLD_S` first: nearly every such pod is bound within
milliseconds, and then the log has nothing to say that the binding does not ("why" answers from
the binding). Bind's success drops the held decision unwritten and marks the pod's row, when it
has one from an earlier filter, `bound` (one statement per batch, not one per pod); a pod still
unbound when the hold ends gets its feasible decision written. Unschedulable and invalid
decisions, and bind's failures, are written in the next batch as before.

`TESSERA["DECISION_LOG_ASYNC"] = False` (the test settings) writes synchronously instead, with
no hold.
"""

from __future__ import annotations

import logging
import time

from django.conf import settings
from django.db import close_old_connections, connections

from controlplane.background import Worker
from controlplane.ledger.services import decisions
from controlplane.ledger.services.decisions import DecisionRecord, Outcome

log = logging.getLogger(__name__)

MAX_QUEUED = 10_000
MAX_BATCH = 500
BATCH_WINDOW_S = 0.2
HOLD_S = 2.0
MAX_HELD = 10_000
IDLE_CLOSE_S = 30.0

Item = tuple[str, object]


class DecisionWriter:
    def __init__(self) -> None:
        self.worker: Worker[Item] = Worker(
            "tessera-decision-log",
            self._handle,
            max_batch=MAX_BATCH,
            window_s=BATCH_WINDOW_S,
            idle_s=IDLE_CLOSE_S,
            close=connections.close_all,
            due=self._next_due,
        )
        self.dropped = 0
        # The worker thread's own: feasible decisions held back, by pod UID, with when their
        # hold ends (insertion order is due order: every hold is HOLD_S long).
        self._held: dict[str, tuple[DecisionRecord, float]] = {}

    def submit(self, kind: str, item: object) -> None:
        if not settings.TESSERA.get("DECISION_LOG_ASYNC", True):
            self._write([(kind, item)], hold=False)
            return
        if self.worker.queued >= MAX_QUEUED:
            self.dropped += 1
            log.warning("decision log queue full: %d entries dropped so far", self.dropped)
            return
        self.worker.submit((kind, item))

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything queued so far is written, held decisions included (tests,
        shutdown)."""
        if settings.TESSERA.get("DECISION_LOG_ASYNC", True):
            self.worker.submit(("flush", None))  # never dropped: past the bound of `submit`
            self.worker.flush(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is queued and held, close the thread's database connection and end the
        thread (the next submit starts a new one)."""
        if not self.worker.alive:
            return
        self.worker.submit(("flush", None))
        self.worker.stop(timeout)

    def _write(self, batch: list[Item], *, hold: bool) -> None:
        """Write a batch in order. With `hold`, feasible decisions wait in `_held` instead."""
        records: list[DecisionRecord] = []
        bound: dict[str, None] = {}  # pod UIDs bound in this batch, in order (their log rows)
        held = self._held if hold else {}
        for kind, item in batch:
            if kind == "decision":
                record: DecisionRecord = item  # type: ignore[assignment]
                uid = record.pod_uid
                bound.pop(uid, None)
                held.pop(uid, None)
                if hold and record.outcome == Outcome.FEASIBLE:
                    held[uid] = (record, time.monotonic() + HOLD_S)
                else:
                    records.append(record)
            elif kind == "bound":
                uid = item  # type: ignore[assignment]
                # Bound at once: the held decision says nothing the binding does not.
                held.pop(uid, None)
                bound[uid] = None
            elif kind == "bind":
                # keep the order: decisions queued before this outcome land first
                waiting = held.pop(item[0], None)  # type: ignore[index]
                if waiting is not None:
                    records.append(waiting[0])
                self._settle(records, bound)
                decisions.record_bind_outcome(*item)  # type: ignore[misc]
            elif kind == "flush":
                records.extend(record for record, _ in held.values())
                held.clear()
        while len(held) > MAX_HELD:  # a flood of unbound pods: write the oldest now
            records.append(held.pop(next(iter(held)))[0])
        self._settle(records, bound)

    @staticmethod
    def _settle(records: list[DecisionRecord], bound: dict[str, None]) -> None:
        decisions.record_decisions(records, list(bound))
        records.clear()
        bound.clear()

    def _release_due(self, now: float) -> list[DecisionRecord]:
        """Held decisions whose hold has ended (their pods are still unbound)."""
        due = []
        for uid, (_record, until) in self._held.items():
            if until > now:
                break
            due.append(uid)
        return [self._held.pop(uid)[0] for uid in due]

    def _next_due(self) -> float | None:
        """Seconds until the first hold ends; None when nothing is held."""
        if not self._held:
            return None
        return next(iter(self._held.values()))[1] - time.monotonic()

    def _handle(self, batch: list[Item]) -> None:
        """The worker's batch (empty when a hold ended): write it, and what is due."""
        # Each batch is this thread's "request": the connection the last batch took goes back
        # (to PostgreSQL's pool), and the batch takes one the backend checked (controlplane/
        # pgpool), a new one when the database ended the old (a restart, a failover), rather
        # than failing the batch and dropping its entries. A batch that fails all the same is
        # dropped (diagnostics only), and the worker goes on.
        close_old_connections()
        self._write(batch, hold=True)
        due = self._release_due(time.monotonic())
        if due:
            decisions.record_decisions(due)


writer = DecisionWriter()


def record(decision: DecisionRecord) -> None:
    """Queue a filter outcome for the log."""
    writer.submit("decision", decision)


def record_bind(pod_uid: str, namespace: str, name: str, outcome: str, summary: str) -> None:
    """Queue what bind did to the pod's latest decision (a failure: success is `record_bound`)."""
    writer.submit("bind", (pod_uid, namespace, name, outcome, summary))


def record_bound(pod_uid: str) -> None:
    """Queue that the pod is bound: its held decision is dropped, its row (if an earlier filter
    wrote one) says `bound`."""
    writer.submit("bound", pod_uid)
