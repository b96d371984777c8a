"""`POST /webhook/mutate`: AdmissionReview v1 in and out, JSONPatch, clear denials."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from controlplane.ledger.services.nodes import InventoryReport, apply_inventory
from tests.builders import card_report, make_node
from tests.extender.builders import plain_pod
from tests.extender.conftest import fixture_pod, post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db


def review(pod: dict[str, Any], operation: str = "CREATE", uid: str = "705ab4f5-6393") -> dict:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": pod["metadata"].get("namespace", "default"),
            "operation": operation,
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def mutate(client, pod, **kw) -> dict:
    response = post(client, "/webhook/mutate", review(pod, **kw))
    assert response.status_code == 200
    body = response.json()
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    assert body["response"]["uid"] == kw.get("uid", "705ab4f5-6393")
    return body["response"]


def apply_patch(pod: dict, response: dict) -> dict:
    """A minimal RFC 6902 'add'/'replace' applier, enough to check the patch does what it says."""
    assert response["patchType"] == "JSONPatch"
    doc = copy.deepcopy(pod)
    for op in json.loads(base64.b64decode(response["patch"])):
        assert op["op"] in ("add", "replace")
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[last] = op["value"]
    return doc


def test_gpu_pod_gets_the_scheduler_name(client) -> None:
    make_node("n1", cards=8)
    pod = fixture_pod()
    pod["spec"]["schedulerName"] = "default-scheduler"
    response = mutate(client, pod)
    assert response["allowed"] is True
    patched = apply_patch(pod, response)
    assert patched["spec"]["schedulerName"] == "tessera-scheduler"
    assert patched["spec"]["containers"] == pod["spec"]["containers"]  # gpu already given


def test_memory_only_container_gets_one_gpu_in_limits_and_requests(client) -> None:
    make_node("n1")
    pod = gpu_pod()
    del pod["spec"]["schedulerName"]
    resources = pod["spec"]["containers"][0]["resources"]
    resources["limits"] = {"nvidia.com/gpumem": "3000", "cpu": "1"}
    resources["requests"] = {"nvidia.com/gpumem": "3000"}
    patched = apply_patch(pod, mutate(client, pod))
    assert patched["spec"]["schedulerName"] == "tessera-scheduler"
    res = patched["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "1" and res["requests"]["nvidia.com/gpu"] == "1"
    assert res["limits"]["cpu"] == "1"


def test_cores_only_in_limits_adds_gpu_to_limits_only(client) -> None:
    make_node("n1")
    pod = gpu_pod(mem=None, cores=30)
    pod["spec"]["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu")
    res = apply_patch(pod, mutate(client, pod))["spec"]["containers"][0]["resources"]
    assert res == {"limits": {"nvidia.com/gpucores": 30, "nvidia.com/gpu": "1"}}


def test_pod_without_managed_resources_is_allowed_untouched(client) -> None:
    response = mutate(client, plain_pod())
    assert response == {"uid": "705ab4f5-6393", "allowed": True}


def test_updates_and_other_kinds_pass(client) -> None:
    pod = gpu_pod()
    pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    assert mutate(client, pod, operation="UPDATE") == {"uid": "705ab4f5-6393", "allowed": True}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda p: p["spec"]["containers"][0].update(securityContext={"privileged": True}),
         "securityContext.privileged"),
        (lambda p: p["spec"].update(nodeName="n1"), "spec.nodeName"),
        (lambda p: p["spec"]["containers"][0]["resources"]["limits"].update(
            {"nvidia.com/gpumem": "90000"}), "largest registered card has 81920 MiB"),
        (lambda p: p["spec"]["containers"][0]["resources"]["limits"].update(
            {"nvidia.com/gpu": "3"}), "no node has more than 2"),
        (lambda p: p["spec"]["containers"][0]["resources"]["limits"].update(
            {"nvidia.com/gpucores": "150"}), "percentage from 0 to 100"),
        (lambda p: p["spec"]["containers"][0]["resources"]["limits"].update(
            {"nvidia.com/gpumem-percentage": "0", "nvidia.com/gpumem": None}),
         "nvidia.com/gpumem"),
        (lambda p: p["spec"]["containers"][0]["resources"]["limits"].update(
            {"nvidia.com/gpumem": "-5"}), "must not be negative"),
        # virtual device memory's opt-in: "true" or "false" only (docs/virtual-memory.md)
        (lambda p: p["metadata"].update(
            annotations={"tessera.io/memory-oversubscription": "yes"}),
         'tessera.io/memory-oversubscription: must be "true" or "false"'),
    ],
)  # fmt: skip
def test_what_can_never_run_is_denied_with_the_field(client, change, needle) -> None:
    make_node("n1", cards=2, memory_mib=81920)
    pod = gpu_pod()
    change(pod)
    response = mutate(client, pod)
    assert response["allowed"] is False
    assert response["status"]["code"] == 403
    assert needle in response["status"]["message"]
    assert "patch" not in response


def test_an_opted_in_pod_may_ask_past_the_card_where_a_card_oversubscribes(client) -> None:
    # 40960 MiB cards at factor 2 with a 16384 MiB host reserve: an opted-in slice may take up
    # to 40960 + 16384 MiB on one (factor x memory would allow 81920, the reserve less).
    report = InventoryReport(
        plugin_version="test",
        cards=(card_report("GPU-v-0", 0, 40960),),
        memory_factor=200,
        spill_reserve_mib=16384,
        host_memory_mib=65536,
    )
    apply_inventory("n1", report, actor="test")

    def asking(mib: int, opted: str | None) -> dict[str, Any]:
        pod = gpu_pod()
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = str(mib)
        if opted is not None:
            pod["metadata"]["annotations"] = {"tessera.io/memory-oversubscription": opted}
        return mutate(client, pod)

    assert asking(45056, "true")["allowed"] is True
    for opted in (None, "false"):  # without the opt-in the card's own memory is the most
        denied = asking(45056, opted)
        assert denied["allowed"] is False
        assert (
            "largest registered card has 40960 MiB, so it could never run"
            in (denied["status"]["message"])
        )
    past = asking(40960 + 16384 + 1, "true")
    assert past["allowed"] is False
    assert "and 57344 MiB for a slice that may spill to the host" in past["status"]["message"]


def test_privileged_container_without_gpus_is_not_our_business(client) -> None:
    pod = plain_pod()
    pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    assert mutate(client, pod)["allowed"] is True


@pytest.mark.parametrize(
    ("body", "needle"),
    [(b"nope", "not JSON"), (b"[]", "request.uid"), (json.dumps({"request": {}}).encode(),
     "request.uid")],
)  # fmt: skip
def test_malformed_reviews_are_a_400(client, body, needle) -> None:
    response = client.post("/webhook/mutate", data=body, content_type="application/json")
    assert response.status_code == 400 and needle in response.json()["error"]


@pytest.mark.parametrize("scheduler", ["volcano", "kai-scheduler", "default-scheduler-2"])
def test_a_gpu_pod_for_another_scheduler_passes_untouched_and_unread(client, scheduler) -> None:
    """Another scheduler's GPU pod is that scheduler's business, even one Tessera would refuse:
    with failurePolicy Fail a denial here would break every batch scheduler beside Tessera."""
    make_node("n1", cards=2, memory_mib=81920)
    pod = gpu_pod()
    pod["spec"]["schedulerName"] = scheduler
    pod["spec"]["nodeName"] = "n1"
    pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = "-5"
    assert mutate(client, pod) == {"uid": "705ab4f5-6393", "allowed": True}


def test_default_scheduler_pods_are_adopted_unless_the_operator_says_not(client, settings) -> None:
    pod = gpu_pod()
    pod["spec"]["schedulerName"] = "default-scheduler"
    patched = apply_patch(pod, mutate(client, pod))
    assert patched["spec"]["schedulerName"] == "tessera-scheduler"

    settings.TESSERA = {**settings.TESSERA, "ADOPTED_SCHEDULERS": ()}
    assert mutate(client, pod) == {"uid": "705ab4f5-6393", "allowed": True}
    # A pod that names no scheduler, or Tessera's own, is still Tessera's.
    del pod["spec"]["schedulerName"]
    patched = apply_patch(pod, mutate(client, pod))
    assert patched["spec"]["schedulerName"] == "tessera-scheduler"
    pod["spec"]["schedulerName"] = "tessera-scheduler"
    pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    assert mutate(client, pod)["allowed"] is False


def test_an_adopted_batch_scheduler_hands_its_gpu_pods_to_tessera(client, settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "ADOPTED_SCHEDULERS": ("default-scheduler", "volcano")}
    pod = gpu_pod()
    pod["spec"]["schedulerName"] = "volcano"
    patched = apply_patch(pod, mutate(client, pod))
    assert patched["spec"]["schedulerName"] == "tessera-scheduler"
