"""/api/v1/pods/<ns>/<name>/why and the allocation endpoints of docs/allocation.md."""

from __future__ import annotations

import pytest

from controlplane.access.roles import Role
from controlplane.ledger.allocation import ANNOTATION, encode
from controlplane.ledger.models import Node, PodBinding
from controlplane.ledger.why import pod_status
from tests.builders import make_node, token_client
from tests.extender.builders import bind_args, filter_args
from tests.extender.conftest import fixture_pod, post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db


def test_why_explains_a_pending_pod_in_plain_words(client) -> None:
    for i in range(3):
        make_node(f"full-{i}", cards=1, memory_mib=2048)
    make_node("cordoned", cards=1, memory_mib=81920)
    Node.objects.filter(name="cordoned").update(cordoned=True)
    post(client, "/scheduler/filter", filter_args(gpu_pod("stuck", "team-a", mem=3000),
         ["full-0", "full-1", "full-2", "cordoned"]))  # fmt: skip

    viewer = token_client("vera", Role.VIEWER)
    response = viewer.get("/api/v1/pods/team-a/stuck/why")
    assert response.status_code == 200
    body = response.json()
    assert body["outcome"] == "unschedulable"
    assert body["summary"] == (
        "0 of 4 nodes can hold it: 3 nodes lack free GPU memory (largest free slice 2048 MiB, "
        "it needs 3000 MiB per GPU); 1 node is cordoned."
    )
    assert body["reason_counts"] == {"InsufficientMemory": 3, "NodeCordoned": 1}
    assert "needs 3000 MiB, the card has 2048 MiB in total" in body["node_reasons"]["full-0"]
    assert body["binding"] is None


def test_why_bounds_the_per_node_reasons_but_counts_every_node(client, settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "DECISION_LOG_MAX_NODES": 5}
    names = [f"ghost-{i}" for i in range(40)]
    post(client, "/scheduler/filter", filter_args(gpu_pod("p"), names))
    body = token_client("vera", Role.VIEWER).get("/api/v1/pods/default/p/why").json()
    assert len(body["node_reasons"]) == 5
    assert body["reason_counts"] == {"UnknownNode": 40} and body["nodes_considered"] == 40


def test_why_needs_a_viewer_and_says_when_it_knows_nothing(client) -> None:
    assert client.get("/api/v1/pods/default/p/why").status_code in (401, 403)
    response = token_client("vera", Role.VIEWER).get("/api/v1/pods/default/unknown/why")
    assert response.status_code == 404 and "schedulerName" in response.json()["error"]
    bad = token_client("vera", Role.VIEWER).get("/api/v1/pods/Bad_NS/p/why")
    assert bad.status_code == 400 and "namespace" in bad.json()["fields"]


def test_why_shows_the_bind_outcome(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())
    post(client, "/scheduler/filter", filter_args(pod, ["n1"]))
    post(client, "/scheduler/bind", bind_args(pod, "n1"))
    body = token_client("vera", Role.VIEWER).get("/api/v1/pods/default/p/why").json()
    assert body["outcome"] == "bound"
    assert body["summary"].startswith("bound on node n1, cards GPU-n1-0. Before that: 1 of 1 node")
    assert body["binding"] == {"phase": "bound", "node": "n1", "pod_uid": "uid-default-p"}


@pytest.fixture
def bound_trainer(client, fake_kube) -> dict:
    make_node("big", cards=2, memory_mib=8000)
    make_node("other", cards=1)
    pod = fake_kube.add(fixture_pod())
    assert post(client, "/scheduler/bind", bind_args(pod, "big")).json() == {"Error": ""}
    return pod


def test_node_reads_the_allocation_of_its_own_pods_only(bound_trainer, fake_kube) -> None:
    path = "/api/v1/allocations/team-a/trainer-7f9c4b6d8-x2kqp"
    response = token_client("big", Role.NODE).get(path)
    assert response.status_code == 200
    annotated = fake_kube.pods[("team-a", "trainer-7f9c4b6d8-x2kqp")]["metadata"]["annotations"]
    assert encode(response.json()) == annotated[ANNOTATION]  # the same record as the annotation
    assert token_client("other", Role.NODE).get(path).status_code == 403
    assert token_client("big", Role.NODE).get("/api/v1/allocations/team-a/nope").status_code == 404
    assert token_client("vera", Role.VIEWER).get(path).status_code == 200


def test_allocated_moves_the_binding_to_allocated_and_checks_devices(bound_trainer) -> None:
    uid = bound_trainer["metadata"]["uid"]
    path = f"/api/v1/allocations/{uid}/containers/trainer/allocated"
    node = token_client("big", Role.NODE)

    wrong = node.post(path, {"devices": ["GPU-big-0"]}, format="json")
    assert wrong.status_code == 409 and "GPU-big-0, GPU-big-1" in wrong.json()["error"]
    assert PodBinding.objects.get(pod_uid=uid).phase == PodBinding.Phase.BOUND

    other = token_client("other", Role.NODE).post(
        path, {"devices": ["GPU-big-1", "GPU-big-0"]}, format="json"
    )
    assert other.status_code == 404
    ok = node.post(path, {"devices": ["GPU-big-1", "GPU-big-0"]}, format="json")
    assert ok.status_code == 200 and ok.json()["phase"] == "allocated"
    binding = PodBinding.objects.get(pod_uid=uid)
    assert binding.phase == PodBinding.Phase.ALLOCATED and binding.allocated_at is not None
    again = node.post(path, {"devices": ["GPU-big-0", "GPU-big-1"]}, format="json")
    assert again.status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"devices": "GPU-big-0"},
        {"devices": [1]},
        {"devices": []},
        {"devices": [""]},  # device IDs are card UUIDs: never blank,
        {"devices": ["GPU big 0"]},  # never with spaces
        [1],
        {"devices": ["GPU-big-0", "GPU-big-1"], "node": "big"},  # an unknown field, refused
    ],
)
def test_allocated_bad_input_is_a_400(bound_trainer, body) -> None:
    uid = bound_trainer["metadata"]["uid"]
    response = token_client("big", Role.NODE).post(
        f"/api/v1/allocations/{uid}/containers/trainer/allocated", body, format="json"
    )
    assert response.status_code == 400 and "error" in response.json()
    assert PodBinding.objects.get(pod_uid=uid).phase == PodBinding.Phase.BOUND


def test_a_viewer_cannot_report_allocations(bound_trainer) -> None:
    uid = bound_trainer["metadata"]["uid"]
    response = token_client("vera", Role.VIEWER).post(
        f"/api/v1/allocations/{uid}/containers/trainer/allocated",
        {"devices": ["GPU-big-0", "GPU-big-1"]},
        format="json",
    )
    assert response.status_code == 403


def test_a_pod_whose_bind_failed_is_pending_and_why_says_so(client, fake_kube) -> None:
    """The reconciler failed its expired reservation (the Binding never came) and no filter ran
    since: the pod is unbound and will be tried again, not "not pending"."""
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())
    post(client, "/scheduler/bind", bind_args(pod, "n1"))
    PodBinding.objects.filter(pod_uid="uid-default-p").update(
        phase=PodBinding.Phase.FAILED,
        reason="the reservation expired: its Binding never reached the API server",
    )
    body = token_client("vera", Role.VIEWER).get("/api/v1/pods/default/p/why").json()
    assert body["outcome"] == "bind_failed"
    assert body["summary"].startswith("failed: the reservation expired")
    # the dashboard's words, from the same answer
    text = pod_status("default", "p").text
    assert text.startswith("Pending: the last bind failed (the reservation expired")
