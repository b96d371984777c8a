"""`POST /scheduler/preempt`: kube-scheduler's candidate victims, answered with the GPU view.

Payloads are shaped like kube-scheduler's `ExtenderPreemptionArgs` (k8s.io/kube-scheduler
extender/v1): `NodeNameToMetaVictims` from a node-cache-capable scheduler, `NodeNameToVictims`
(whole pods) otherwise; the answer is always `NodeNameToMetaVictims`.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.builders import make_node
from tests.extender.builders import bind_args, plain_pod
from tests.extender.conftest import post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db


def _bound(client, fake_kube, name: str, node: str, mem: int, priority: int) -> dict[str, Any]:
    pod = gpu_pod(name, "ml", mem=mem)
    pod["spec"]["priority"] = priority
    fake_kube.add(pod)
    answer = post(client, "/scheduler/bind", bind_args(pod, node)).json()
    assert answer == {"Error": ""}, answer
    return pod


def _preemptor(mem: int, priority: int) -> dict[str, Any]:
    pod = gpu_pod("urgent", "serving", mem=mem)
    pod["spec"]["priority"] = priority
    return pod


def _meta(*pods: dict[str, Any], violations: int = 0) -> dict[str, Any]:
    return {
        "Pods": [{"UID": p["metadata"]["uid"]} for p in pods],
        "NumPDBViolations": violations,
    }


def _uids(answer: dict[str, Any], node: str) -> list[str]:
    return [p["UID"] for p in answer["NodeNameToMetaVictims"][node]["Pods"]]


def preempt(client, body: Any):
    return post(client, "/scheduler/preempt", body)


def test_a_node_where_the_victims_free_enough_gpu_room_keeps_its_victims(client, fake_kube):
    make_node("n1", cards=1, memory_mib=10000)
    low = _bound(client, fake_kube, "low", "n1", 8000, priority=0)
    body = {"Pod": _preemptor(6000, 100), "NodeNameToMetaVictims": {"n1": _meta(low)}}
    answer = preempt(client, body)
    assert answer.status_code == 200
    assert answer.json() == {
        "NodeNameToMetaVictims": {
            "n1": {"Pods": [{"UID": low["metadata"]["uid"]}], "NumPDBViolations": 0}
        }
    }


def test_gpu_victims_are_added_where_the_schedulers_own_free_no_gpu_room(client, fake_kube):
    make_node("n1", cards=1, memory_mib=10000)
    a = _bound(client, fake_kube, "a", "n1", 3000, priority=0)
    b = _bound(client, fake_kube, "b", "n1", 5000, priority=0)
    # kube-scheduler would evict a plain pod for CPU; the GPU still lacks room: b must go too
    # (one pod whose slice is enough, rather than two).
    cpu = plain_pod("cpu-hog", "ml")
    cpu["metadata"]["uid"] = "uid-cpu-hog"
    body = {"Pod": _preemptor(6000, 100), "NodeNameToMetaVictims": {"n1": _meta(cpu, violations=1)}}
    answer = preempt(client, body).json()
    assert _uids(answer, "n1") == ["uid-cpu-hog", b["metadata"]["uid"]]
    assert answer["NodeNameToMetaVictims"]["n1"]["NumPDBViolations"] == 1
    assert a["metadata"]["uid"] not in _uids(answer, "n1")


def test_a_node_where_no_lower_priority_pod_can_make_room_is_dropped(client, fake_kube):
    make_node("n1", cards=1, memory_mib=10000)
    make_node("n2", cards=1, memory_mib=10000)
    _bound(client, fake_kube, "vip", "n1", 8000, priority=1000)
    low = _bound(client, fake_kube, "low", "n2", 8000, priority=0)
    body = {
        "Pod": _preemptor(6000, 100),
        "NodeNameToMetaVictims": {"n1": _meta(), "n2": _meta(), "not-tessera": _meta()},
    }
    answer = preempt(client, body).json()
    assert list(answer["NodeNameToMetaVictims"]) == ["n2"]
    assert _uids(answer, "n2") == [low["metadata"]["uid"]]


def test_whole_victim_pods_from_a_scheduler_without_a_node_cache(client, fake_kube):
    make_node("n1", cards=1, memory_mib=10000)
    low = _bound(client, fake_kube, "low", "n1", 8000, priority=0)
    body = {
        "Pod": _preemptor(6000, 100),
        "NodeNameToVictims": {"n1": {"Pods": [low], "NumPDBViolations": 0}},
    }
    answer = preempt(client, body).json()
    assert _uids(answer, "n1") == [low["metadata"]["uid"]]


def test_a_pod_that_asks_no_gpu_gets_the_candidates_back_unchanged(client, fake_kube):
    make_node("n1", cards=1, memory_mib=10000)
    low = _bound(client, fake_kube, "low", "n1", 8000, priority=0)
    pod = plain_pod("web", "ml")
    body = {"Pod": pod, "NodeNameToMetaVictims": {"n1": _meta(low), "other": _meta()}}
    answer = preempt(client, body).json()
    assert set(answer["NodeNameToMetaVictims"]) == {"n1", "other"}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"NodeNameToMetaVictims": {}}, "Pod"),
        ({"Pod": {}, "NodeNameToMetaVictims": []}, "NodeNameToMetaVictims"),
        ({"Pod": {}, "NodeNameToMetaVictims": {"n1": {"Pods": [{}]}}}, "UID"),
        (
            {"Pod": {}, "NodeNameToMetaVictims": {"n1": {"NumPDBViolations": -1}}},
            "NumPDBViolations",
        ),
        ({"Pod": {}, "NodeNameToMetaVictims": {"": {}}}, "NodeNameToMetaVictims"),
    ],
)
def test_malformed_preemption_args_get_a_400_naming_the_field(client, body, field) -> None:
    answer = preempt(client, body)
    assert answer.status_code == 400
    assert field in answer.json()["Error"]
