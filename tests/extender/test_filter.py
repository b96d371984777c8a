"""`POST /scheduler/filter` with kube-scheduler's payloads: NodeNames, Nodes, old spellings."""

from __future__ import annotations

import json

import pytest

from controlplane.ledger.models import NamespaceQuota, PodBinding, SchedulingDecision, Slice
from controlplane.ledger.services import bindings
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.extender.builders import filter_args, plain_pod, v1_node
from tests.extender.conftest import fixture_pod, post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db

EMPTY_KEYS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}


def test_full_v1_pod_gets_every_feasible_node_and_a_reason_for_the_rest(client) -> None:
    make_node("big", cards=2, memory_mib=8000)  # init 2000 + 2 x 3000 per card: fits
    make_node("small", cards=2, memory_mib=2500)  # 3000 MiB per GPU cannot fit, ever
    make_node("one-card", cards=1, memory_mib=80000)  # trainer needs 2 distinct cards
    make_node("l4", cards=4, memory_mib=23034, model="NVIDIA L4")  # excluded by use-gputype
    make_node("busy", cards=2, memory_mib=8000)
    bindings.bind_pod(parse_pod(gpu_pod("hog", gpus=2, mem=7000)), "busy")
    names = ["big", "small", "one-card", "l4", "busy", "ghost"]

    response = post(client, "/scheduler/filter", filter_args(fixture_pod(), names))

    assert response.status_code == 200
    body = response.json()
    assert set(body) == EMPTY_KEYS
    assert body["Error"] == "" and body["Nodes"] is None
    assert body["NodeNames"] == ["big"]
    failed, unresolvable = body["FailedNodes"], body["FailedAndUnresolvableNodes"]
    assert set(failed) | set(unresolvable) == set(names) - {"big"}
    assert not set(failed) & set(unresolvable)
    # waiting can help on "busy" (the hog may end): a plain failure with the free room in it
    assert "init container 'warmup' needs 2000 MiB, 1000 MiB free" in failed["busy"]
    # nothing ending on these nodes helps: the scheduler should not preempt for them
    assert "in total" in unresolvable["small"]
    assert "excluded" in unresolvable["l4"] and "use-gputype" in unresolvable["l4"]
    assert "not in Tessera's inventory" in unresolvable["ghost"]
    assert "one-card" in unresolvable


def test_lowercase_keys_of_old_schedulers_are_accepted(client) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    response = post(client, "/scheduler/filter", {"pod": gpu_pod(), "nodenames": ["n1"]})
    assert response.json()["NodeNames"] == ["n1"]


def test_full_node_objects_in_nodes_come_back_filtered(client) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    make_node("n2", cards=1, memory_mib=500)
    node_list = {"metadata": {"resourceVersion": "9"}, "items": [v1_node("n1"), v1_node("n2")]}
    response = post(client, "/scheduler/filter", {"Pod": gpu_pod(), "Nodes": node_list})
    body = response.json()
    assert [n["metadata"]["name"] for n in body["Nodes"]["items"]] == ["n1"]
    assert body["Nodes"]["items"][0] == v1_node("n1")  # the object itself, untouched
    assert body["NodeNames"] == ["n1"]
    assert "n2" in body["FailedAndUnresolvableNodes"]


def test_a_pod_without_managed_resources_passes_untouched(client) -> None:
    names = ["anything", "not-registered", "n3"]
    response = post(client, "/scheduler/filter", filter_args(plain_pod(), names))
    body = response.json()
    assert body["NodeNames"] == names
    assert body["FailedNodes"] is None and body["FailedAndUnresolvableNodes"] is None
    assert not SchedulingDecision.objects.exists()  # not Tessera's pod: nothing recorded


def test_a_thousand_node_names(client) -> None:
    for i in range(20):
        make_node(f"gpu-{i:04d}", cards=2, memory_mib=16000)
    names = [f"gpu-{i:04d}" for i in range(1000)]  # 980 of them unknown to the ledger
    response = post(client, "/scheduler/filter", filter_args(gpu_pod(mem=8000), names))
    body = response.json()
    assert body["NodeNames"] == names[:20]
    assert len(body["FailedAndUnresolvableNodes"]) == 980
    decision = SchedulingDecision.objects.get()
    assert decision.nodes_considered == 1000
    assert decision.reason_counts == {"UnknownNode": 980}
    assert decision.summary.startswith("20 of 1000 nodes can hold it: 980 nodes are not registered")


def test_every_returned_name_was_in_the_input_and_order_is_kept(client) -> None:
    for name in ("c", "a", "b"):
        make_node(name, cards=1, memory_mib=10000)
    response = post(client, "/scheduler/filter", filter_args(gpu_pod(), ["b", "c"]))
    assert response.json()["NodeNames"] == ["b", "c"]


def test_quota_refuses_every_node_when_even_the_smallest_placement_exceeds(client) -> None:
    make_node("n1", cards=2, memory_mib=10000)
    NamespaceQuota.objects.create(namespace="team-a", gpumem_mib=4000)
    bindings.bind_pod(parse_pod(gpu_pod("first", "team-a", mem=3000)), "n1")

    body = post(
        client, "/scheduler/filter", filter_args(gpu_pod("second", "team-a", mem=2000), ["n1"])
    )
    body = body.json()
    assert body["NodeNames"] == []
    assert "over its GPU quota" in body["FailedNodes"]["n1"]  # waiting (pods ending) helps
    decision = SchedulingDecision.objects.get(name="second")
    assert decision.reason_counts == {"QuotaExceeded": 1}

    alone = post(
        client, "/scheduler/filter", filter_args(gpu_pod("huge", "team-a", mem=5000), ["n1"])
    )
    assert "over its GPU quota" in alone.json()["FailedAndUnresolvableNodes"]["n1"]

    # Within quota: the node is offered.
    ok = post(client, "/scheduler/filter", filter_args(gpu_pod("small", "team-a", mem=500), ["n1"]))
    assert ok.json()["NodeNames"] == ["n1"]


def test_invalid_gpu_request_is_unresolvable_on_every_node_with_the_field_named(client) -> None:
    make_node("n1")
    pod = gpu_pod(mem=None)
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = "-3"
    body = post(client, "/scheduler/filter", filter_args(pod, ["n1"])).json()
    assert body["NodeNames"] == []
    assert "nvidia.com/gpumem" in body["FailedAndUnresolvableNodes"]["n1"]
    assert SchedulingDecision.objects.get().outcome == SchedulingDecision.Outcome.INVALID


def test_a_bad_opt_in_is_unresolvable_on_every_node_naming_the_annotation(client) -> None:
    make_node("n1")
    pod = gpu_pod()
    pod["metadata"]["annotations"] = {"tessera.io/memory-oversubscription": "maybe"}
    body = post(client, "/scheduler/filter", filter_args(pod, ["n1"])).json()
    assert body["NodeNames"] == []
    why = body["FailedAndUnresolvableNodes"]["n1"]
    assert "tessera.io/memory-oversubscription" in why and '"true" or "false"' in why


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not JSON"),
        (b"", 400, "empty"),
        (b"\xff\xfe", 400, "not JSON"),
        (b'{"Pod": {"x": NaN}, "NodeNames": ["n1"]}', 400, "not JSON"),  # not JSON's numbers
        (json.dumps([1, 2]).encode(), 200, "JSON object"),
        (json.dumps({"NodeNames": ["n1"]}).encode(), 200, "Pod: is missing"),
        (json.dumps({"Pod": "x", "NodeNames": ["n1"]}).encode(), 200, "Pod: must be a JSON object"),
        (json.dumps({"Pod": {}, "NodeNames": "n1"}).encode(), 200, "NodeNames: must be a list"),
        (json.dumps({"Pod": {}, "NodeNames": [1]}).encode(), 200, "NodeNames[0]"),
        (json.dumps({"Pod": {}, "NodeNames": ["x" * 300]}).encode(), 200, "at most 253"),
        (json.dumps({"Pod": {}}).encode(), 200, "NodeNames: is missing"),
        (json.dumps({"Pod": {}, "Nodes": {"items": [{"x": 1}]}}).encode(), 200, "metadata"),
    ],
)
def test_bad_input_gets_a_clear_error_and_changes_nothing(client, body, status, needle) -> None:
    make_node("n1")
    response = client.post("/scheduler/filter", data=body, content_type="application/json")
    assert response.status_code == status
    assert needle in response.json()["Error"]
    assert not SchedulingDecision.objects.exists()
    assert not PodBinding.objects.exists() and not Slice.objects.exists()


@pytest.mark.parametrize(
    ("value", "needle"),
    [("-1", "must not be negative"), ("99999999999", "16 TiB"), ("lots", "nvidia.com/gpumem"),
     (True, "nvidia.com/gpumem")],
)  # fmt: skip
def test_negative_or_absurd_sizes_are_refused_per_node(client, value, needle) -> None:
    make_node("n1")
    pod = gpu_pod()
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] = value
    body = post(client, "/scheduler/filter", filter_args(pod, ["n1"])).json()
    assert body["NodeNames"] == []
    assert needle in body["FailedAndUnresolvableNodes"]["n1"]
    assert not PodBinding.objects.exists()


def test_a_ten_megabyte_body_is_refused_before_it_is_read(client) -> None:
    make_node("n1")
    huge = json.dumps(filter_args(gpu_pod(), ["n" * 200] * 50_000)).encode()
    assert len(huge) > 10_000_000
    response = client.post("/scheduler/filter", data=huge, content_type="application/json")
    assert response.status_code == 413
    assert "over the limit" in response.json()["error"]
    assert not SchedulingDecision.objects.exists()


def test_method_other_than_post_is_refused(client) -> None:
    response = client.get("/scheduler/filter")
    assert response.status_code == 405 and response["Allow"] == "POST"
