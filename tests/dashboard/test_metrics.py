"""/metrics: auth, the ledger's figures, the extender's instruments, fixed query count."""

from __future__ import annotations

from typing import Any

import prometheus_client
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from controlplane import metrics as instruments
from controlplane.access.roles import Role
from controlplane.dashboard import metrics
from controlplane.ledger.models import Card, NamespaceQuota
from tests.builders import token_client
from tests.dashboard.builders import decision, make_node, pod
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse exposition text into {(sample name, sorted labels): value}."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def card_labels(node: str, uuid: str, index: int, model: str = "NVIDIA A100-SXM4-80GB"):
    return tuple(sorted({"node": node, "card": uuid, "index": str(index), "model": model}.items()))


@pytest.fixture
def cluster() -> None:
    make_node("n1", cards=2, memory_mib=10000)
    pod("a", "n1", gpu_container("main", mem=3000, cores=20), namespace="team-a")
    pod("b", "n1", gpu_container("main", mem=1000, cores=10), namespace="team-b", phase="reserved")
    decision("stuck", namespace="team-c")
    NamespaceQuota.objects.create(namespace="team-a", gpumem_mib=8000, gpus=None)
    Card.objects.filter(uuid="GPU-n1-1").update(cordoned=True)


@pytest.mark.parametrize(
    ("who", "status"),
    [(None, 401), ("bad", 401), ("node", 403), ("viewer", 200), ("admin", 200)],
)
def test_metrics_needs_a_human_token(cluster: None, who: str | None, status: int) -> None:
    client = APIClient()
    if who == "bad":
        client.credentials(HTTP_AUTHORIZATION="Bearer nope")
    elif who == "node":
        client = token_client("n1", Role.NODE)
    elif who in ("viewer", "admin"):
        client = token_client(f"prom-{who}", Role(who))
    response = client.get("/metrics", HTTP_ACCEPT="application/openmetrics-text; version=1.0.0")
    assert response.status_code == status
    if status == 200:
        assert response["Content-Type"].startswith("text/plain")
        assert b"tessera_card_memory_mib" in response.content


def test_ledger_figures(cluster: None) -> None:
    text = token_client("prom", Role.VIEWER).get("/metrics").content.decode()
    got = samples(text)
    used = {
        uuid: got[("tessera_card_memory_allocated_mib", card_labels("n1", uuid, i))]
        for i, uuid in enumerate(["GPU-n1-0", "GPU-n1-1"])
    }
    assert sorted(used.values()) == [1000, 3000]
    assert got[("tessera_card_memory_mib", card_labels("n1", "GPU-n1-0", 0))] == 10000
    assert got[("tessera_card_slots", card_labels("n1", "GPU-n1-0", 0))] == 10
    assert got[("tessera_card_cordoned", card_labels("n1", "GPU-n1-1", 1))] == 1
    assert got[("tessera_card_healthy", card_labels("n1", "GPU-n1-1", 1))] == 1
    compute = sum(v for (name, _), v in got.items() if name == "tessera_card_compute_allocated")
    assert compute == 30
    slice_key = None
    for name, labels in got:
        if name == "tessera_slice_memory_limit_mib" and ("pod", "a") in labels:
            slice_key = labels
    assert slice_key is not None and dict(slice_key)["container"] == "main"
    assert got[("tessera_slice_memory_limit_mib", slice_key)] == 3000
    assert got[("tessera_slice_compute_limit_percent", slice_key)] == 20
    assert got[("tessera_quota_used_memory_mib", (("namespace", "team-a"),))] == 3000
    assert got[("tessera_quota_limit_memory_mib", (("namespace", "team-a"),))] == 8000
    assert ("tessera_quota_limit_gpus", (("namespace", "team-a"),)) not in got  # unlimited
    assert got[("tessera_quota_used_gpus", (("namespace", "team-b"),))] == 1
    assert got[("tessera_pending_gpu_pods", (("reason", "reserved"),))] == 1
    assert got[("tessera_pending_gpu_pods", (("reason", "unschedulable"),))] == 1


def test_fast_writer_matches_prometheus_client(cluster: None) -> None:
    """The view's own writer and prometheus_client's, over the same collector, agree."""
    registry = CollectorRegistry()
    registry.register(metrics.LedgerCollector())
    theirs = samples(generate_latest(registry).decode())
    ours = samples(metrics.render_text(metrics.read_ledger()).decode())
    drop = "tessera_ledger_scrape_seconds"
    assert {k: v for k, v in ours.items() if k[0] != drop} == {
        k: v for k, v in theirs.items() if k[0] != drop
    }


def test_label_values_are_escaped() -> None:
    family = metrics.Family("x", "doc", ("a",))
    family.add(('quote " back \\ nl \n',), 1)
    text = metrics.render_text([family]).decode()
    assert text.endswith('x{a="quote \\" back \\\\ nl \\n"} 1\n')
    parsed = samples(text)
    assert parsed[("x", (("a", 'quote " back \\ nl \n'),))] == 1


def test_extender_instruments_are_exported(cluster: None) -> None:
    instruments.EXTENDER_LATENCY.labels(verb="filter").observe(0.012)
    instruments.BIND_OUTCOMES.labels(outcome="bound").inc()
    text = token_client("prom", Role.VIEWER).get("/metrics").content.decode()
    got = samples(text)
    assert got[("tessera_extender_request_seconds_count", (("verb", "filter"),))] >= 1
    assert got[("tessera_bind_outcomes_total", (("outcome", "bound"),))] >= 1


def test_scrape_query_count_is_fixed(cluster: None, monkeypatch: Any) -> None:
    from datetime import timedelta

    from controlplane.access import authentication

    monkeypatch.setattr(authentication, "LAST_USED_RESOLUTION", timedelta(days=1))
    client = token_client("prom", Role.VIEWER)
    client.get("/metrics")  # first use of the token writes last_used_at

    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert client.get("/metrics").status_code == 200
        return len(ctx.captured_queries)

    small = count()
    for i in range(5):
        make_node(f"m{i}", cards=3, memory_mib=10000)
        for j in range(3):
            pod(f"p{i}{j}", f"m{i}", gpu_container(mem=100), namespace=f"ns{j}")
        NamespaceQuota.objects.create(namespace=f"q{i}", gpus=1)
    assert count() == small


def test_multiprocess_registry_is_used_when_configured(monkeypatch: Any, tmp_path: Any) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert instruments.process_registry() is not prometheus_client.REGISTRY
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    assert instruments.process_registry() is prometheus_client.REGISTRY


def test_cards_by_mode_and_draining(cluster: None) -> None:
    from controlplane.ledger.services import modes

    Card.objects.filter(uuid="GPU-n1-1").update(mode="mps")
    busy = Card.objects.filter(slices__binding__name="a").get().uuid
    make_node("n2", cards=1)
    Card.objects.filter(node__name="n2").update(mig_capable=True)
    modes.set_card_mode("GPU-n2-0", "mig", "ann")  # idle: at once
    modes.set_card_mode(busy, "exclusive", "ann")  # holds pod a: drains, keeps its mode
    got = samples(token_client("prom", Role.VIEWER).get("/metrics").content.decode())
    by_mode = {
        dict(labels)["mode"] + ("/draining" if dict(labels)["draining"] == "true" else ""): value
        for (name, labels), value in got.items()
        if name == "tessera_cards_by_mode"
    }
    expected = {"shared": 0, "mig": 1, "mps": 1, "exclusive": 0, "shared/draining": 1}
    expected |= {f"{m}/draining": 0 for m in ("mig", "mps", "exclusive")}
    if busy == "GPU-n1-1":  # pod a landed on the mps card: that one drains instead
        expected |= {"mps": 0, "mps/draining": 1, "shared": 1, "shared/draining": 0}
    assert by_mode == expected
