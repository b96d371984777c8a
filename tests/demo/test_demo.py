"""`manage.py demo`: simulated pods go through the real extender endpoints over HTTP."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command

from controlplane.demo import workload as demo
from controlplane.kube.models import EmbeddedPod
from controlplane.ledger.models import PodBinding, Slice

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def embedded(settings):
    settings.TESSERA = {**settings.TESSERA, "KUBE_MODE": "embedded"}
    call_command("demo", "--setup-only", stdout=io.StringIO())


def test_pods_arrive_are_bound_over_http_run_and_end(live_server, embedded, monkeypatch) -> None:
    monkeypatch.setattr(demo, "CATALOGUE", (("team-a", "nb", 1, 4096, None, 10, (0, 0)),))
    workload = demo.DemoWorkload(
        live_server.url, report=lambda: None, log=lambda _: None, seed=1, arrivals=(4, 4)
    )
    stats = workload.tick()
    assert stats["arrived"] == 4 and stats["bound"] == 4, stats
    pods = list(EmbeddedPod.objects.all())
    assert len(pods) == 4 and all(p.node_name for p in pods)
    assert all(p.obj["status"]["phase"] == "Running" for p in pods)
    assert all("tessera.io/allocation" in p.obj["metadata"]["annotations"] for p in pods)
    assert PodBinding.objects.filter(phase=PodBinding.Phase.BOUND).count() == 4
    assert Slice.objects.filter(active=True).count() == 4

    workload.arrivals = (0, 0)
    assert workload.tick()["ended"] == 4
    assert not EmbeddedPod.objects.exists()
    assert PodBinding.objects.filter(phase=PodBinding.Phase.RELEASED).count() == 4
    assert not Slice.objects.filter(active=True).exists()


def test_pods_that_fit_nowhere_stay_pending(live_server, embedded, monkeypatch) -> None:
    monkeypatch.setattr(demo, "CATALOGUE", (("team-a", "huge", 1, 900000, None, 0, (9, 9)),))
    workload = demo.DemoWorkload(
        live_server.url, report=lambda: None, log=lambda _: None, seed=1, arrivals=(1, 1)
    )
    assert workload.tick()["pending"] == 1
    assert not PodBinding.objects.exists()


def test_the_command_runs_the_workload_in_embedded_mode(live_server, embedded) -> None:
    out = io.StringIO()
    call_command(
        "demo", "--url", live_server.url, "--ticks", "2", "--interval", "0", "--seed", "3",
        stdout=out,
    )  # fmt: skip
    assert "demo workload: scheduling through" in out.getvalue()


def test_the_workload_refuses_a_real_cluster(settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "KUBE_MODE": "kubeconfig"}
    with pytest.raises(Exception, match="embedded"):
        call_command("demo", "--ticks", "1", stdout=io.StringIO())
