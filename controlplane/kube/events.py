"""Kubernetes Events on a pod for what Tessera did with it, so `kubectl describe pod` tells it.

Bind records `Allocated` (Normal: the node, and per container the cards with their memory and
compute) or `AllocationFailed` (Warning: why). Events are diagnostics, never allocation state:
they leave bind's path through a bounded queue, one background worker per process posts them
(`controlplane.background`), and one that cannot be posted (the API server away for all of
`ATTEMPTS`, or the queue full) is dropped and counted (`tessera_pod_events_dropped_total`), as
kube-scheduler's own event broadcaster drops what it cannot write.

`TESSERA["EVENTS_ASYNC"] = False` (the test settings) posts each event on the caller's path.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from django.conf import settings

from controlplane.background import Worker
from controlplane.kube import adapter
from controlplane.kube.base import KubeError
from controlplane.metrics import POD_EVENTS_DROPPED

log = logging.getLogger(__name__)

COMPONENT = "tessera-extender"
REPORTING_CONTROLLER = "tessera.io/extender"
MAX_QUEUED = 10_000
ATTEMPTS = 3
RETRY_S = 0.5
# The API server refuses an events.k8s.io note over 1 kB; a core Event's message is kept to
# the same size, so one long reason never makes an event unwritable.
MAX_MESSAGE = 1024

NORMAL = "Normal"
WARNING = "Warning"


def _instance() -> str:
    return os.environ.get("POD_NAME") or socket.gethostname()


def pod_event(
    namespace: str, name: str, uid: str, reason: str, message: str, kind: str = NORMAL
) -> dict[str, Any]:
    """A core/v1 Event about the pod, as `kubectl describe pod` lists it."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 1] + "…"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        # The name only has to be unique in the namespace: the pod's, as kubectl's own are.
        "metadata": {"name": f"{name}.{uuid.uuid4().hex[:16]}", "namespace": namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "namespace": namespace,
            "name": name,
            "uid": uid,
        },
        "reason": reason,
        "message": message,
        "type": kind,
        "source": {"component": COMPONENT},
        "reportingComponent": REPORTING_CONTROLLER,
        "reportingInstance": _instance(),
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


def _post(event: dict[str, Any]) -> bool:
    """Post one event, retrying a temporary failure; False when it was dropped."""
    for attempt in range(ATTEMPTS):
        try:
            adapter.get_kube().create_event(event["metadata"]["namespace"], event)
            return True
        except KubeError as exc:
            if exc.applied is False and exc.status is not None:  # refused: trying again is futile
                log.warning("event %s refused: %s", event["reason"], exc.message)
                break
            if attempt + 1 < ATTEMPTS:
                time.sleep(RETRY_S * (attempt + 1))
        except Exception:  # a bug in one event must not end the thread that posts the others
            log.exception("posting event %s failed", event["reason"])
            break
    POD_EVENTS_DROPPED.inc()
    return False


class Recorder:
    """One per process (`recorder`); thread-safe."""

    def __init__(self) -> None:
        self.worker: Worker[dict[str, Any]] = Worker(
            "tessera-pod-events", self._post_each, max_queued=MAX_QUEUED
        )

    def submit(self, event: dict[str, Any]) -> None:
        if not settings.TESSERA.get("EVENTS_ASYNC", True):
            _post(event)
            return
        if not self.worker.submit(event):
            POD_EVENTS_DROPPED.inc()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far was posted or dropped."""
        return self.worker.flush(timeout)

    @staticmethod
    def _post_each(batch: list[dict[str, Any]]) -> None:
        for event in batch:
            _post(event)


recorder = Recorder()
atexit.register(recorder.flush, 2.0)


def record(
    namespace: str, name: str, uid: str, reason: str, message: str, kind: str = NORMAL
) -> None:
    """Queue an event about the pod."""
    recorder.submit(pod_event(namespace, name, uid, reason, message, kind))
