"""The control plane's own Prometheus instruments, in one module every layer may import.

Counters and histograms that code increments as it works live here (they are process state, in
prometheus_client's default registry); the gauges read from the ledger at scrape time and the
`/metrics` view are the dashboard's (`controlplane.dashboard.metrics`).

    with EXTENDER_LATENCY.labels(verb="filter").time(): ...
    BIND_OUTCOMES.labels(outcome="bound").inc()

Under gunicorn with several workers, set `PROMETHEUS_MULTIPROC_DIR` (an empty, writable
directory) before start so that every worker's counts are summed at scrape time instead of each
scrape seeing one worker (`process_registry`).
"""

from __future__ import annotations

import os

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, multiprocess

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

EXTENDER_LATENCY = Histogram(
    "tessera_extender_request_seconds",
    "Time the scheduler extender took to answer kube-scheduler, by verb.",
    ["verb"],  # filter | prioritize | bind
    buckets=_SECONDS,
)
BIND_APISERVER = Histogram(
    "tessera_extender_bind_apiserver_seconds",
    "The API server's share of a bind (reading the pod, the Binding): a slow API server shows "
    "here, not in Tessera's own time.",
    buckets=_SECONDS,
)
BIND_OUTCOMES = Counter(
    "tessera_bind_outcomes",
    "Results of the extender's bind, by outcome (e.g. bound, conflict, refused, error).",
    ["outcome"],
)
POD_EVENTS_DROPPED = Counter(
    "tessera_pod_events_dropped",
    "Kubernetes Events about pods (Allocated, AllocationFailed) not written: the API server "
    "refused them or was away, or too many were queued.",
)
CONFIRMATION_RETRIES = Counter(
    "tessera_confirmation_retries",
    "Batches of bind confirmations (reserved -> bound) that failed and were written again.",
)


def process_registry() -> CollectorRegistry:
    """The registry of this process's instruments (all workers' when multiprocess is on)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return REGISTRY
