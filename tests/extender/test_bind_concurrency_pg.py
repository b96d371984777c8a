"""Binds through the HTTP views on real PostgreSQL connections, many threads at once.

Each thread posts to /scheduler/bind with its own Django test client and its own database
connection, so the node row locks of lock -> recompute -> commit are real.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Sum
from django.test import Client
from django.utils import timezone

from controlplane.kube import base as kube
from controlplane.ledger.models import PodBinding, Slice
from controlplane.ledger.selectors import expired_reservations
from tests.builders import make_node, run_at_once, using_postgres
from tests.extender.builders import bind_args
from tests.extender.conftest import post
from tests.pods import gpu_pod

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not using_postgres(), reason="needs DATABASE_URL=postgres://... (make test runs it)"
    ),
]

THREADS = 64


def bind_all(pods: list[dict], node: str) -> Counter[str]:
    def binding(pod: dict):
        def job() -> str:
            response = post(Client(), "/scheduler/bind", bind_args(pod, node))
            error = response.json()["Error"] if response.status_code == 200 else "HTTP"
            if not error:
                return "bound"
            if "no longer fits" in error:
                return "refused"
            if "refused the Binding" in error:
                return "apiserver"
            return f"other: {response.status_code} {error}"

        return job

    return run_at_once([binding(p) for p in pods])


def card_use() -> dict[str, int]:
    return dict(
        Slice.objects.filter(active=True)
        .values("card__uuid")
        .annotate(mem=Sum("memory_mib"))
        .values_list("card__uuid", "mem")
    )


def test_64_concurrent_binds_to_one_node_never_over_allocate(fake_kube) -> None:
    assert connection.vendor == "postgresql"
    make_node("n1", cards=2, memory_mib=10000)  # exactly 20 pods of 1000 MiB fit
    pods = [fake_kube.add(gpu_pod(f"p{i}", mem=1000)) for i in range(THREADS)]

    outcomes = bind_all(pods, "n1")

    assert outcomes == Counter({"bound": 20, "refused": 44}), outcomes
    assert card_use() == {"GPU-n1-0": 10000, "GPU-n1-1": 10000}
    assert len(fake_kube.bind_calls) == 20  # one Binding per bound pod, none for the refused
    assert PodBinding.objects.filter(phase=PodBinding.Phase.BOUND).count() == 20
    assert not PodBinding.objects.filter(phase=PodBinding.Phase.RESERVED).exists()
    bound_on_api = {n for (ns, n), p in fake_kube.pods.items() if p["spec"].get("nodeName")}
    assert bound_on_api == set(PodBinding.objects.values_list("name", flat=True))


def test_api_server_failures_under_contention_leave_no_reservation(fake_kube) -> None:
    make_node("n1", cards=2, memory_mib=10000)
    pods = [fake_kube.add(gpu_pod(f"p{i}", mem=1000)) for i in range(THREADS)]
    failing = {f"p{i}" for i in range(0, THREADS, 2)}
    original = fake_kube.bind_pod

    def flaky(namespace, name, uid, node, annotations):
        if name in failing:
            raise kube.KubeError("API server answered 500: etcdserver: leader changed", 500)
        original(namespace, name, uid, node, annotations)

    fake_kube.bind_pod = flaky
    outcomes = bind_all(pods, "n1")
    # A pod that came while failing pods still held their reservations was refused for room it
    # gets once they give it back: kube-scheduler retries such a pod, and so does the test.
    bound = set(
        PodBinding.objects.filter(phase=PodBinding.Phase.BOUND).values_list("name", flat=True)
    )
    retried = bind_all([p for p in pods if p["metadata"]["name"] not in failing | bound], "n1")

    # every pod that lost at the API server gave its room back, so the 20 slots still went to
    # pods that could be bound: nothing is held by a pod the API server never bound
    assert outcomes["bound"] + retried["bound"] == 20, (outcomes, retried)
    assert not [k for k in outcomes + retried if k.startswith("other")], (outcomes, retried)
    assert card_use() == {"GPU-n1-0": 10000, "GPU-n1-1": 10000}
    active = set(
        PodBinding.objects.filter(phase__in=PodBinding.ACTIVE_PHASES).values_list("name", flat=True)
    )
    assert not active & failing
    assert PodBinding.objects.filter(phase=PodBinding.Phase.BOUND).count() == 20
    assert not Slice.objects.filter(active=True, binding__name__in=failing).exists()


def test_crash_between_commit_and_api_call_is_found_on_postgres(fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod("victim"))

    class ProcessDied(BaseException):
        pass

    def die() -> None:
        raise ProcessDied

    fake_kube.fail_bind = die
    with pytest.raises(ProcessDied):
        post(Client(), "/scheduler/bind", bind_args(pod, "n1"))
    binding = PodBinding.objects.get()
    assert binding.phase == PodBinding.Phase.RESERVED
    assert expired_reservations(timezone.now()) == []
    [found] = expired_reservations(binding.deadline + timedelta(milliseconds=1))
    assert found.pod_uid == binding.pod_uid and found.node == "n1"
