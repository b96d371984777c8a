"""reserved -> bound once the API server accepted a pod's Binding: off bind's path, batched,
retried until written.

A confirmation is allocation state (a reservation past its deadline is taken for a Binding that
never happened), so it rides a channel of its own that never drops an entry. Bind queues (pod
UID, when the Binding was accepted) here; one thread per process writes what is queued, one
statement per batch (`bindings.confirm_bindings`), `BATCH_WINDOW_S` after the first entry of a
batch. A batch that fails (the database away, a failover) stays queued and is written again,
after a backoff with jitter, with what arrived meanwhile, until it is written; each retry is
counted (`tessera_confirmation_retries_total`). The queue is bounded: past `MAX_QUEUED` a submit
writes its confirmation on the caller's path instead (and queues it only if that fails too).
At process exit the queue is written. Only a crash can lose the last entries, and the
reconciler repairs that: a reservation whose pod is bound is confirmed when it next looks at the
pod, at the latest once the reservation's deadline has passed (docs/extender.md).

`TESSERA["CONFIRM_ASYNC"] = False` (the test settings) writes each confirmation on the
caller's path.
"""

from __future__ import annotations

import atexit
import logging
import random
import threading
import time
from collections import deque
from datetime import datetime

from django.conf import settings
from django.db import connections

from controlplane.ledger.services.bindings import confirm_bindings
from controlplane.metrics import CONFIRMATION_RETRIES

log = logging.getLogger(__name__)

BATCH_WINDOW_S = 0.05
MAX_BATCH = 1000
MAX_QUEUED = 100_000
IDLE_CLOSE_S = 30.0
RETRY_BASE_S = 0.1
RETRY_CAP_S = 5.0

Entry = tuple[str, datetime]


def retry_delay(failures: int) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2**failures)] seconds."""
    return random.uniform(0, min(RETRY_CAP_S, RETRY_BASE_S * 2**failures))


class Confirmer:
    """One per process (`confirmer`); thread-safe."""

    def __init__(self) -> None:
        self._items: deque[Entry] = deque()
        self._wake = threading.Event()  # something was queued
        self._hurry = threading.Event()  # a flush or stop waits: no batch window
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._progress = threading.Condition()
        self._queued = 0  # entries ever queued, and of those, written
        self._written = 0
        self._stopping = False

    def submit(self, pod_uid: str, at: datetime) -> None:
        """Confirm the pod's reservation (soon, or now past the bound)."""
        if not settings.TESSERA.get("CONFIRM_ASYNC", True):
            confirm_bindings([(pod_uid, at)])
            return
        if len(self._items) >= MAX_QUEUED:
            try:
                confirm_bindings([(pod_uid, at)])
                return
            except Exception:  # the database is away: queue it all the same, never drop it
                log.exception("confirming %s on the caller's path failed; queued", pod_uid)
        with self._progress:
            self._queued += 1
            self._items.append((pod_uid, at))
        self._ensure_thread()
        self._wake.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is written; False if that took past `timeout`."""
        deadline = time.monotonic() + timeout
        with self._progress:
            target = self._queued
            self._hurry.set()
            self._wake.set()
            while self._written < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._progress.wait(left)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is queued, then end the thread (the next submit starts a new one)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._stopping = True
        self._hurry.set()
        self._wake.set()
        thread.join(timeout)
        self._stopping = False

    @property
    def pending(self) -> int:
        """Entries queued and not yet written."""
        return self._queued - self._written

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._start_lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(
                        target=self._run, name="tessera-confirmations", daemon=True
                    )
                    self._thread.start()

    def _take(self, batch: dict[str, datetime]) -> int:
        """Move queued entries into the batch; how many."""
        taken = 0
        while self._items and len(batch) < MAX_BATCH:
            uid, at = self._items.popleft()
            batch[uid] = at  # the same pod twice: one row, the later time
            taken += 1
        return taken

    def _run(self) -> None:
        batch: dict[str, datetime] = {}
        taken = 0  # entries in `batch` (a pod submitted twice counts twice)
        failures = 0
        while True:
            if not batch:
                if not self._items:
                    if self._stopping:
                        break
                    self._wake.clear()
                    if not self._items and not self._wake.wait(IDLE_CLOSE_S):
                        connections.close_all()  # idle: give the connection back
                    continue
                self._hurry.wait(BATCH_WINDOW_S)  # one statement for what arrives meanwhile
            taken += self._take(batch)
            if not batch:
                continue
            try:
                confirm_bindings(list(batch.items()))
            except Exception:
                failures += 1
                CONFIRMATION_RETRIES.inc()
                log.exception(
                    "confirming %d reservations failed (attempt %d); retrying", len(batch), failures
                )
                connections.close_all()  # a broken connection is opened afresh next time
                time.sleep(retry_delay(failures))
                continue
            failures = 0
            batch.clear()
            with self._progress:
                self._written += taken
                if not self._items:
                    self._hurry.clear()
                self._progress.notify_all()
            taken = 0
        connections.close_all()


confirmer = Confirmer()
atexit.register(confirmer.stop)


def confirm_later(pod_uid: str, at: datetime) -> None:
    """Queue the pod's confirmation: the API server accepted its Binding at `at`."""
    confirmer.submit(pod_uid, at)
