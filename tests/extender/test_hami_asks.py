"""The extender's answers to HAMi's other asks: a MIG pod waits for good, a mutex pod avoids busy
cards, a 0%-compute pod avoids a card whose compute is booked, a sidecar and a priority reach
the signed allocation, a bad policy is an invalid request."""

from __future__ import annotations

import json

import pytest

from controlplane.ledger import allocation
from controlplane.ledger.models import SchedulingDecision
from controlplane.ledger.services import bindings
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.extender.builders import bind_args, filter_args
from tests.extender.conftest import post
from tests.pods import gpu_container, gpu_pod

pytestmark = pytest.mark.django_db


def filter_body(client, pod, names):
    response = post(client, "/scheduler/filter", filter_args(pod, names))
    assert response.status_code == 200
    return response.json()


def corpus_like_nodes() -> list[str]:
    make_node("a100", cards=2, memory_mib=81920)
    make_node("h200", cards=1, memory_mib=143771, model="NVIDIA H200")
    make_node("rtx", cards=2, memory_mib=11264, model="NVIDIA GeForce RTX 2080 Ti")
    return ["a100", "h200", "rtx"]


def test_a_mig_pod_is_unresolvable_everywhere_with_a_clear_reason(client) -> None:
    names = corpus_like_nodes()
    pod = gpu_pod("gpu-pod", gpus=2, mem=8000, annotations={"nvidia.com/vgpu-mode": "mig"})
    body = filter_body(client, pod, names)
    assert body["NodeNames"] == [] and body["FailedNodes"] in (None, {})
    unresolvable = body["FailedAndUnresolvableNodes"]
    assert set(unresolvable) == set(names)
    assert all(r.startswith("no card is in MIG mode") for r in unresolvable.values())
    decision = SchedulingDecision.objects.get(name="gpu-pod")
    assert decision.reason_counts == {"ModeMismatch": 3}
    assert "vgpu-mode" in decision.summary


def test_a_mutex_pod_avoids_the_card_another_pod_holds(client) -> None:
    names = corpus_like_nodes()
    bindings.bind_pod(parse_pod(gpu_pod("gpu-pod", mem=3000, cores=30)), "h200")
    mutex = gpu_pod(
        "gpu-pod-mutex", mem=3000, cores=30, annotations={"hami.io/gpu-scheduler-policy": "mutex"}
    )
    body = filter_body(client, mutex, names)
    assert body["NodeNames"] == ["a100", "rtx"]
    assert "mutex" in body["FailedNodes"]["h200"]  # the holder may end: not unresolvable


def test_a_zero_percent_pod_avoids_a_card_whose_compute_is_booked(client) -> None:
    names = corpus_like_nodes()
    bindings.bind_pod(parse_pod(gpu_pod("gpu-pod1", mem=50000, cores=60)), "h200")
    bindings.bind_pod(parse_pod(gpu_pod("gpu-pod", mem=300, cores=40)), "h200")
    body = filter_body(client, gpu_pod("vector-add", mem=3000), names)
    assert body["NodeNames"] == ["a100", "rtx"]
    assert "all of its compute is booked" in body["FailedNodes"]["h200"]


def test_an_unknown_gpu_policy_is_an_invalid_request(client) -> None:
    names = corpus_like_nodes()
    pod = gpu_pod(annotations={"hami.io/gpu-scheduler-policy": "fastest"})
    body = filter_body(client, pod, names)
    assert body["NodeNames"] == []
    reason = body["FailedAndUnresolvableNodes"]["a100"]
    assert "hami.io/gpu-scheduler-policy" in reason and "binpack, spread, numa, mutex" in reason


def test_bind_signs_the_sidecar_and_the_priority(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=20000)
    pod = gpu_pod("served", mem=5000)
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/priority"] = 1
    side = gpu_container("proxy", mem=2000)
    side["restartPolicy"] = "Always"
    pod["spec"]["initContainers"] = [side]
    fake_kube.add(pod)
    response = post(client, "/scheduler/bind", bind_args(pod, "n1"))
    assert response.json() == {"Error": ""}
    [(*_, annotations)] = fake_kube.bind_calls
    record = json.loads(annotations[allocation.ANNOTATION])
    proxy, main = record["containers"]
    assert (proxy["name"], proxy["init"], proxy["sidecar"], "priority" in proxy) == (
        "proxy", True, True, False
    )  # fmt: skip
    assert (main["name"], main["init"], main["priority"], "sidecar" in main) == (
        "main", False, 1, False
    )  # fmt: skip


@pytest.mark.parametrize(
    ("limits", "annotations", "allowed", "fragment"),
    [
        (
            {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 8000},
            {"nvidia.com/vgpu-mode": "mig"},
            True,
            "",
        ),
        ({"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 0}, {}, True, ""),
        (
            {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 101},
            {},
            False,
            "gpumem-percentage: must be a percentage from 0 to 100, got 101",
        ),
        (
            {"nvidia.com/gpu": 1, "nvidia.com/priority": 5},
            {},
            False,
            "nvidia.com/priority: must be 0 (high) or 1 (low), got 5",
        ),
        (
            {"nvidia.com/gpu": 1},
            {"nvidia.com/vgpu-mode": "vgpu"},
            False,
            "nvidia.com/vgpu-mode: must name card modes among hami-core, mig, mps",
        ),
        ({"nvidia.com/gpu": 1}, {"hami.io/gpu-scheduler-policy": "mutex,numa"}, True, ""),
    ],
)
def test_admission_of_hamis_asks(client, limits, annotations, allowed, fragment) -> None:
    make_node("a100", cards=2)
    pod = gpu_pod(annotations=annotations)
    pod["spec"].pop("schedulerName")
    pod["spec"]["containers"][0]["resources"]["limits"] = limits
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "operation": "CREATE", "object": pod,
                        "kind": {"group": "", "version": "v1", "kind": "Pod"},
                        "namespace": "default"}}  # fmt: skip
    answer = post(client, "/webhook/mutate", body).json()["response"]
    assert answer["allowed"] is allowed
    if allowed:
        assert answer["patchType"] == "JSONPatch"  # routed to Tessera's scheduler
    else:
        assert fragment in answer["status"]["message"]
