"""Bind's confirmations (reserved -> bound): off bind's path, batched, retried until written."""

from __future__ import annotations

from datetime import datetime

import pytest
from django.db import OperationalError
from django.utils import timezone
from prometheus_client import REGISTRY

from controlplane.ledger.models import PodBinding
from controlplane.ledger.services import confirmations
from tests.builders import make_node
from tests.extender.builders import bind_args
from tests.extender.conftest import post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def async_confirmations(settings, monkeypatch):
    settings.TESSERA = {**settings.TESSERA, "CONFIRM_ASYNC": True}
    calls: list[list[tuple[str, datetime]]] = []
    real = confirmations.confirm_bindings

    def spy(batch: list[tuple[str, datetime]]) -> int:
        calls.append(list(batch))
        return real(batch)

    monkeypatch.setattr(confirmations, "confirm_bindings", spy)
    yield calls
    confirmations.confirmer.stop()


def phases() -> list[str]:
    return sorted(PodBinding.objects.filter(name__startswith="b").values_list("phase", flat=True))


def test_bind_confirms_off_its_path_many_pods_in_one_statement(
    client, fake_kube, async_confirmations, monkeypatch
) -> None:
    # the batch ends at the flush
    monkeypatch.setattr(confirmations.confirmer.worker, "window_s", 5.0)
    make_node("n1", cards=1, memory_mib=10000)
    pods = [fake_kube.add(gpu_pod(f"b{i}")) for i in range(3)]
    started = timezone.now()
    for pod in pods:
        assert post(client, "/scheduler/bind", bind_args(pod, "n1")).json() == {"Error": ""}
    answered = timezone.now()
    # Not on bind's path: the reservations hold their slices, the confirmer confirms them later.
    assert phases() == ["reserved"] * 3
    assert confirmations.confirmer.flush()
    assert [[uid for uid, _ in call] for call in async_confirmations] == [
        [p["metadata"]["uid"] for p in pods]
    ]
    for binding in PodBinding.objects.filter(name__startswith="b"):
        assert binding.phase == "bound" and binding.deadline is None
        assert started <= binding.bound_at <= answered
    assert confirmations.confirmer.pending == 0


def test_a_failed_batch_is_written_again_not_dropped(
    client, fake_kube, async_confirmations, monkeypatch
) -> None:
    monkeypatch.setattr(confirmations, "RETRY_BASE_S", 0.01)
    real = confirmations.confirm_bindings  # the spy, which records every attempt
    failures = iter([OperationalError("server closed the connection unexpectedly")] * 2)

    def flaky(batch: list[tuple[str, datetime]]) -> int:
        error = next(failures, None)
        if error is not None:
            async_confirmations.append([("failed", timezone.now())])
            raise error
        return real(batch)

    monkeypatch.setattr(confirmations, "confirm_bindings", flaky)
    retries_before = REGISTRY.get_sample_value("tessera_confirmation_retries_total") or 0.0
    make_node("n1", cards=1, memory_mib=10000)
    for i in range(2):
        pod = fake_kube.add(gpu_pod(f"b{i}"))
        assert post(client, "/scheduler/bind", bind_args(pod, "n1")).json() == {"Error": ""}
    assert confirmations.confirmer.flush()
    assert phases() == ["bound", "bound"]
    written = [call for call in async_confirmations if call[0][0] != "failed"]
    assert sum(len(call) for call in written) == 2  # each pod written once, after the failures
    assert len(async_confirmations) - len(written) == 2
    retries = REGISTRY.get_sample_value("tessera_confirmation_retries_total") or 0.0
    assert retries == retries_before + 2


def test_past_the_queue_bound_a_confirmation_is_written_on_the_callers_path(
    client, fake_kube, async_confirmations, monkeypatch
) -> None:
    monkeypatch.setattr(confirmations, "MAX_QUEUED", 0)
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod("b0"))
    assert post(client, "/scheduler/bind", bind_args(pod, "n1")).json() == {"Error": ""}
    assert phases() == ["bound"]  # before any flush
    assert confirmations.confirmer.pending == 0


def test_stop_writes_what_is_queued(client, fake_kube, async_confirmations, monkeypatch) -> None:
    monkeypatch.setattr(confirmations.confirmer.worker, "window_s", 30.0)
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod("b0"))
    assert post(client, "/scheduler/bind", bind_args(pod, "n1")).json() == {"Error": ""}
    confirmations.confirmer.stop()
    assert phases() == ["bound"]
