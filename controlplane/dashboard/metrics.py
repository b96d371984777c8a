"""Prometheus metrics: the ledger read at scrape time, and the `/metrics` view.

`/metrics` needs a bearer token (or session) of a human role, viewer or higher: see
docs/dashboard.md for how to give Prometheus one. The ledger collector reads the database in a
fixed number of queries whatever the cluster size (cards, slices, quotas + usage, two pending
counts), so a scrape costs the same at 10 cards and at 10,000. The process's own instruments
(the extender's latency and bind outcomes, ...) are `controlplane.metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.http import HttpResponse
from django.utils import timezone
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.request import Request
from rest_framework.views import APIView

from controlplane import rawsql
from controlplane.access.permissions import IsViewer
from controlplane.dashboard import selectors
from controlplane.ledger import usage as ledger_usage
from controlplane.ledger.models import Card, Slice
from controlplane.metrics import process_registry
from controlplane.reconciler.models import ReconcileRun

CARD_LABELS = ("node", "card", "index", "model")
SLICE_LABELS = ("namespace", "pod", "container", "node", "card")

Sample = tuple[tuple[str, ...], float]


@dataclass(slots=True)
class Family:
    """One gauge family: name, help, label names, and (label values, value) samples."""

    name: str
    doc: str
    labels: tuple[str, ...] = ()
    samples: list[Sample] = field(default_factory=list)

    def add(self, values: tuple[str, ...], value: float) -> None:
        self.samples.append((values, value))


def read_ledger() -> list[Family]:
    """Every ledger gauge, read in a fixed number of queries (cards, card usage (2), slices,
    quotas (3), pending (2)), whatever the cluster size."""
    started = time.monotonic()
    families = _cards_and_slices() + _quotas()
    reserved, unschedulable = selectors.pending_counts()
    pending = Family(
        "tessera_pending_gpu_pods",
        "GPU pods waiting: reserved (waiting for the Binding) or unschedulable (no room).",
        ("reason",),
    )
    pending.add(("reserved",), reserved)
    pending.add(("unschedulable",), unschedulable)
    scrape = Family("tessera_ledger_scrape_seconds", "Time taken to read the ledger for a scrape.")
    scrape.add((), time.monotonic() - started)
    return [*families, pending, *_reconciler(), scrape]


def _reconciler() -> list[Family]:
    """The reconciler's runs (recorded by the worker process, read here in two queries)."""
    last = Family(
        "tessera_reconcile_last_duration_seconds",
        "Duration of the latest reconcile run.",
        ("mode",),
    )
    age = Family(
        "tessera_reconcile_last_run_timestamp_seconds", "When the latest reconcile run finished."
    )
    latest = (
        ReconcileRun.objects.filter(finished_at__isnull=False)
        .order_by("-started_at")
        .values_list("mode", "duration_ms", "finished_at")
        .first()
    )
    if latest is not None:
        last.add((latest[0],), (latest[1] or 0) / 1000.0)
        age.add((), latest[2].timestamp())
    drift = Family(
        "tessera_reconcile_drift_24h",
        "Drift the reconciler found and repaired (or flagged) in the last 24 hours, by kind.",
        ("kind",),
    )
    since = timezone.now() - timedelta(hours=24)
    totals: dict[str, int] = {}
    for row in ReconcileRun.objects.filter(started_at__gte=since).values_list("drift", flat=True):
        for kind, count in (row or {}).items():
            totals[kind] = totals.get(kind, 0) + int(count)
    for kind, count in sorted(totals.items()):
        drift.add((kind,), count)
    return [last, age, drift]


def _cards_and_slices() -> list[Family]:
    def card_family(name: str, doc: str) -> Family:
        return Family(f"tessera_card_{name}", doc, CARD_LABELS)

    memory = card_family("memory_mib", "Card memory in MiB.")
    memory_used = card_family("memory_allocated_mib", "Card memory held by slices (MiB).")
    compute = card_family("compute_units", "Card compute units (100 = whole card).")
    compute_used = card_family("compute_allocated", "Compute units held by slices.")
    slots = card_family("slots", "Most slices the card holds at once.")
    slots_used = card_family("slots_allocated", "Slots held by slices.")
    healthy = card_family("healthy", "1 when the node plugin reports the card healthy.")
    cordoned = card_family("cordoned", "1 when an operator cordoned the card.")
    present = card_family("present", "1 when the card is in its node's latest report.")
    held = ledger_usage.card_usage()
    # Every mode and drain state, zeros included, so a series does not vanish when its last card
    # changes mode.
    by_mode = {(mode, draining): 0 for mode in Card.Mode.values for draining in ("false", "true")}
    where: dict[int, tuple[str, str]] = {}
    for row in rawsql.rows_of(
        Card.objects.order_by().values_list(
            "id",
            "uuid",
            "index",
            "model",
            "node__name",
            "memory_mib",
            "compute_units",
            "slots",
            "healthy",
            "cordoned",
            "present",
            "mode",
            "pending_mode",
        )
    ):
        card_id, uuid, index, model, node = row[:5]
        where[card_id] = (node, uuid)
        labels = (node, uuid, str(index), model)
        used = held.get(card_id, ledger_usage.EMPTY_CARD)
        memory.add(labels, row[5])
        memory_used.add(labels, used.memory_mib)
        compute.add(labels, row[6])
        compute_used.add(labels, used.cores)
        slots.add(labels, row[7])
        slots_used.add(labels, used.slots)
        healthy.add(labels, int(row[8]))
        cordoned.add(labels, int(row[9]))
        present.add(labels, int(row[10]))
        by_mode[(row[11], "true" if row[12] else "false")] += 1

    modes = Family(
        "tessera_cards_by_mode",
        "Cards in each mode (docs/card-modes.md); draining: a mode change waits for the card's "
        "slices to end, and it takes no new ones.",
        ("mode", "draining"),
    )
    for (mode, draining), count in sorted(by_mode.items()):
        modes.add((mode, draining), count)

    slice_memory = Family(
        "tessera_slice_memory_limit_mib",
        "Memory limit of an active slice (MiB), per pod container and card.",
        SLICE_LABELS,
    )
    slice_compute = Family(
        "tessera_slice_compute_limit_percent",
        "Compute limit of an active slice (percent of the card).",
        SLICE_LABELS,
    )
    rows = rawsql.rows_of(
        Slice.objects.filter(active=True)
        .order_by()
        .values_list(
            "card_id",
            "memory_mib",
            "compute_percent",
            "binding__namespace",
            "binding__name",
            "container_name",
        )
    )
    for card_id, mem, cores, namespace, pod, container in rows:
        node, uuid = where.get(card_id, ("", str(card_id)))
        labels = (namespace, pod, container, node, uuid)
        slice_memory.add(labels, mem)
        slice_compute.add(labels, cores)
    return [
        memory,
        memory_used,
        compute,
        compute_used,
        slots,
        slots_used,
        healthy,
        cordoned,
        present,
        modes,
        slice_memory,
        slice_compute,
    ]


def _quotas() -> list[Family]:
    dims = (
        ("memory_mib", "GPU memory (MiB)", "gpumem_mib", "used_memory_mib"),
        ("cores", "compute (sum of percents)", "gpucores", "used_cores"),
        ("gpus", "slices", "gpus", "used_gpus"),
    )
    used = {
        d[0]: Family(f"tessera_quota_used_{d[0]}", f"A namespace's {d[1]} in use.", ("namespace",))
        for d in dims
    }
    limit = {
        d[0]: Family(
            f"tessera_quota_limit_{d[0]}",
            f"A namespace's quota on {d[1]}; absent when unlimited.",
            ("namespace",),
        )
        for d in dims
    }
    for row in selectors.quota_rows():
        for name, _, limit_attr, used_attr in dims:
            used[name].add((row.namespace,), getattr(row, used_attr))
            value = getattr(row, limit_attr)
            if value is not None:
                limit[name].add((row.namespace,), value)
    return [*used.values(), *limit.values()]


class LedgerCollector(Collector):
    """The ledger's gauges for a prometheus_client registry (the /metrics view writes the same
    families with `render_text`, which is much faster at tens of thousands of samples)."""

    def collect(self) -> Iterator[Metric]:
        for family in read_ledger():
            gauge = GaugeMetricFamily(family.name, family.doc, labels=list(family.labels))
            for values, value in family.samples:
                gauge.add_metric(list(values), value)
            yield gauge


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else floatToGoString(value)


def render_text(families: Iterable[Family]) -> bytes:
    """Prometheus text format (0.0.4) for gauge families.

    prometheus_client's writer re-validates and re-escapes every label of every sample; at
    20,000 slices that is most of a scrape. Here a card's or a slice's label string is built
    once and shared by all its families.
    """
    out: list[str] = []
    label_text: dict[tuple[tuple[str, ...], tuple[str, ...]], str] = {}
    for family in families:
        doc = family.doc.replace("\\", "\\\\").replace("\n", "\\n")
        out.append(f"# HELP {family.name} {doc}\n# TYPE {family.name} gauge\n")
        for values, value in family.samples:
            key = (family.labels, values)
            text = label_text.get(key)
            if text is None:
                pairs = ",".join(
                    f'{k}="{_escape_label(v)}"' for k, v in zip(family.labels, values, strict=True)
                )
                text = label_text[key] = f"{{{pairs}}}" if pairs else ""
            out.append(f"{family.name}{text} {_number(value)}\n")
    return "".join(out).encode("utf-8")


class _FirstRenderer(BaseContentNegotiation):
    """Prometheus asks for OpenMetrics or text; errors still answer in the API's JSON shape."""

    def select_parser(self, request: Request, parsers: list[Any]) -> Any:
        return parsers[0] if parsers else None

    def select_renderer(
        self, request: Request, renderers: list[Any], format_suffix: str | None = None
    ) -> tuple[Any, str]:
        return renderers[0], renderers[0].media_type


class MetricsView(APIView):
    """GET /metrics: Prometheus text exposition (viewer role or higher)."""

    permission_classes = [IsViewer]
    content_negotiation_class = _FirstRenderer
    schema = None  # not part of the REST API's schema

    def get(self, request: Request) -> HttpResponse:
        body = generate_latest(process_registry()) + render_text(read_ledger())
        return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
