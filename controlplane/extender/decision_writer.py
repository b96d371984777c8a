"""Off the hot path: the decision log is written by one background thread per process.

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
import threading
import time
from collections import deque

from django.conf import settings
from django.db import close_old_connections, connections

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
URGENT = ("flush", "stop")  # entries that end the batch window at once (and are never dropped)


class DecisionWriter:
    def __init__(self) -> None:
        # Entries wait in a deque (append and popleft are atomic under the GIL) and a submit
        # wakes the thread only when it is idle or the entry is urgent: a queue.Queue notified
        # the waiting thread on every put, a thread switch per filter and per bind that showed
        # as 5 % of the sidecar's GIL time under load.
        self._items: deque[Item] = deque()
        self._wake = threading.Event()
        self._idle = False
        self._urgent = False  # a flush or stop is queued: no batch window
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.dropped = 0
        # The writer thread's own: feasible decisions held back, by pod UID, with when their
        # hold ends (insertion order is due order: every hold is HOLD_S long).
        self._held: dict[str, tuple[DecisionRecord, float]] = {}

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._start_lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(
                        target=self._run, name="tessera-decision-log", daemon=True
                    )
                    self._thread.start()

    def submit(self, kind: str, item: object) -> None:
        if not settings.TESSERA.get("DECISION_LOG_ASYNC", True):
            self._write([(kind, item)], hold=False)
            return
        self._ensure_thread()
        if len(self._items) >= MAX_QUEUED and kind not in URGENT:
            self.dropped += 1
            log.warning("decision log queue full: %d entries dropped so far", self.dropped)
            return
        if kind in URGENT:
            self._urgent = True
        self._items.append((kind, item))
        if self._idle or kind in URGENT:
            self._idle = False  # one wake is enough until the thread looks again
            self._wake.set()

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything queued so far is written, held decisions included (tests,
        shutdown)."""
        done = threading.Event()
        self.submit("flush", done)
        if settings.TESSERA.get("DECISION_LOG_ASYNC", True):
            done.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is queued and held, close the thread's database connection and end the
        thread (the next submit starts a new one)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._urgent = True
        self._items.append(("stop", None))
        self._wake.set()
        thread.join(timeout)

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
                self._settle(records, bound)
                item.set()  # type: ignore[attr-defined]
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

    def _next_wait(self) -> float:
        if not self._held:
            return IDLE_CLOSE_S
        first = next(iter(self._held.values()))[1]
        return min(max(first - time.monotonic(), 0.0), IDLE_CLOSE_S)

    def _gather(self) -> list[Item] | None:
        """The next batch: what arrives within BATCH_WINDOW_S of the first entry (less when a
        flush or stop comes); [] when a hold ends first; None when the writer was idle for
        IDLE_CLOSE_S."""
        self._idle = True  # before looking: a submit after the look sees it and wakes us
        if not self._items:
            self._wake.wait(self._next_wait())
        self._idle = False
        self._wake.clear()
        if not self._items:
            return [] if self._held else None
        # Gather what arrives for a moment: one upsert of many rows costs about what one
        # of a single row does (a burst of filters would otherwise write row by row).
        if not self._urgent and len(self._items) < MAX_BATCH:
            self._wake.wait(BATCH_WINDOW_S)  # only an urgent entry cuts it short
            self._wake.clear()
        batch: list[Item] = []
        while self._items and len(batch) < MAX_BATCH:
            batch.append(self._items.popleft())
            if batch[-1][0] in URGENT:
                self._urgent = any(kind in URGENT for kind, _ in self._items)
                break
        return batch

    def _run(self) -> None:
        while True:
            batch = self._gather()
            if batch is None:
                connections.close_all()  # idle: give the connection back
                continue
            stopping = any(kind == "stop" for kind, _ in batch)
            work = [item for item in batch if item[0] != "stop"]
            if stopping:
                work.append(("flush", threading.Event()))  # what is held is written too
            # Each batch is this thread's "request": its kept connection is checked before the
            # batch uses it (CONN_HEALTH_CHECKS) and replaced when the database ended it (a
            # restart, a failover), rather than failing the batch and dropping its entries.
            close_old_connections()
            try:
                self._write(work, hold=True)
                due = self._release_due(time.monotonic())
                if due:
                    decisions.record_decisions(due)
            except Exception:  # diagnostics only: log, drop this batch, keep serving
                log.exception("writing %d decision log entries failed", len(work))
                for kind, item in work:
                    if kind == "flush":
                        item.set()  # type: ignore[attr-defined]
                connections.close_all()
            if stopping:
                connections.close_all()
                return


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
