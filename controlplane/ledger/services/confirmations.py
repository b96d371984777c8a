"""reserved -> bound once the API server accepted a pod's Binding: off bind's path, batched,
retried until written.

A confirmation is allocation state (a reservation past its deadline is taken for a Binding that
never happened), so it rides a channel of its own that never drops an entry. Bind queues (pod
UID, when the Binding was accepted) here; one background worker per process
(`controlplane.background`) writes what is queued, one statement per batch
(`bindings.confirm_bindings`), `BATCH_WINDOW_S` after the first entry of a batch. A batch that
fails (the database away, a failover) stays queued and is written again, after a backoff with
jitter (the worker's `backoff_delay`), with what arrived meanwhile, until it is written; each
retry is counted (`tessera_confirmation_retries_total`). Not a Celery task with retry options,
as the reconciler's are: a task per confirmation would put a broker round trip on bind's path
and give up the one statement per batch. The queue is bounded: past `MAX_QUEUED` a submit
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
from datetime import datetime

from django.conf import settings
from django.db import connections

from controlplane.background import Worker, backoff_delay
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


def _retry_after(failures: int) -> float:
    """Count a failed batch's retry; how long to wait before it (backoff with full jitter)."""
    CONFIRMATION_RETRIES.inc()
    return backoff_delay(failures, RETRY_BASE_S, RETRY_CAP_S)


def _confirm(batch: list[Entry]) -> None:
    confirm_bindings(list(dict(batch).items()))  # the same pod twice: one row, the later time


class Confirmer:
    """One per process (`confirmer`); thread-safe."""

    def __init__(self) -> None:
        self.worker: Worker[Entry] = Worker(
            "tessera-confirmations",
            _confirm,
            max_batch=MAX_BATCH,
            window_s=BATCH_WINDOW_S,
            idle_s=IDLE_CLOSE_S,
            close=connections.close_all,
            retry=_retry_after,
        )

    def submit(self, pod_uid: str, at: datetime) -> None:
        """Confirm the pod's reservation (soon, or now past the bound)."""
        if not settings.TESSERA.get("CONFIRM_ASYNC", True):
            confirm_bindings([(pod_uid, at)])
            return
        if self.worker.queued >= MAX_QUEUED:
            try:
                confirm_bindings([(pod_uid, at)])
                return
            except Exception:  # the database is away: queue it all the same, never drop it
                log.exception("confirming %s on the caller's path failed; queued", pod_uid)
        self.worker.submit((pod_uid, at))

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is written; False if that took past `timeout`."""
        return self.worker.flush(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is queued, then end the thread (the next submit starts a new one)."""
        self.worker.stop(timeout)

    @property
    def pending(self) -> int:
        """Entries queued and not yet written."""
        return self.worker.pending


confirmer = Confirmer()
atexit.register(confirmer.stop)


def confirm_later(pod_uid: str, at: datetime) -> None:
    """Queue the pod's confirmation: the API server accepted its Binding at `at`."""
    confirmer.submit(pod_uid, at)
