"""Off the hot path: the decision log is written by one background thread per process.

Filter answers the scheduler first; its decision (and bind's outcome) is queued here and written
moments later, in batches, through `services.record_decisions`. The log is diagnostics for "why
pending?", not allocation state: a process that dies loses its last few queued entries, which
the next filter of those pods writes again. The queue is bounded; when it is full an entry is
dropped (and counted), never the scheduler kept waiting.

`TESSERA["DECISION_LOG_ASYNC"] = False` (the test settings) writes synchronously instead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from django.conf import settings
from django.db import connections

from controlplane.extender import services
from controlplane.extender.services import DecisionRecord

log = logging.getLogger(__name__)

MAX_QUEUED = 10_000
MAX_BATCH = 200
BATCH_WINDOW_S = 0.05
IDLE_CLOSE_S = 30.0


class DecisionWriter:
    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, object]] = queue.Queue(MAX_QUEUED)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.dropped = 0

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
            self._write([(kind, item)])
            return
        self._ensure_thread()
        try:
            self._queue.put_nowait((kind, item))
        except queue.Full:
            self.dropped += 1
            log.warning("decision log queue full: %d entries dropped so far", self.dropped)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything queued so far is written (tests, shutdown)."""
        done = threading.Event()
        self.submit("flush", done)
        if settings.TESSERA.get("DECISION_LOG_ASYNC", True):
            done.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is queued, close the thread's database connection and end the thread (the
        next submit starts a new one)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._queue.put(("stop", None))
        thread.join(timeout)

    @staticmethod
    def _write(batch: list[tuple[str, object]]) -> None:
        decisions: list[DecisionRecord] = []
        for kind, item in batch:
            if kind == "decision":
                decisions.append(item)  # type: ignore[arg-type]
            elif kind == "bind":
                # keep the order: decisions queued before this outcome land first
                services.record_decisions(decisions)
                decisions = []
                services.record_bind_outcome(*item)  # type: ignore[misc]
            elif kind == "flush":
                services.record_decisions(decisions)
                decisions = []
                item.set()  # type: ignore[attr-defined]
        services.record_decisions(decisions)

    def _run(self) -> None:
        while True:
            try:
                first = self._queue.get(timeout=IDLE_CLOSE_S)
            except queue.Empty:
                connections.close_all()  # idle: give the connection back
                continue
            if first[0] == "stop":
                connections.close_all()
                return
            # Gather what arrives for a moment: one upsert of many rows costs about what one
            # of a single row does (a burst of filters would otherwise write row by row).
            batch = [first]
            until = time.monotonic() + BATCH_WINDOW_S
            while len(batch) < MAX_BATCH and first[0] != "flush":
                try:
                    batch.append(self._queue.get(timeout=max(until - time.monotonic(), 0)))
                except queue.Empty:
                    break
                if batch[-1][0] in ("flush", "stop"):
                    break
            stopping = any(kind == "stop" for kind, _ in batch)
            try:
                self._write([item for item in batch if item[0] != "stop"])
            except Exception:  # diagnostics only: log, drop this batch, keep serving
                log.exception("writing %d decision log entries failed", len(batch))
                for kind, item in batch:
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
    """Queue what bind did to the pod's latest decision."""
    writer.submit("bind", (pod_uid, namespace, name, outcome, summary))
