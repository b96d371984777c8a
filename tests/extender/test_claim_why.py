"""Why-pending for a pod waiting on a ResourceClaim (DRA mode): the REST API's why, the
dashboard's pod page and `kubectl tessera why` give the scheduler's reason and Tessera's answer
over the published ResourceSlices (closest cards, what would make it fit, the quota)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.access.roles import Role
from controlplane.cli.main import why_table
from controlplane.kube import adapter
from controlplane.ledger.services import quotas
from controlplane.ledger.services.quotas import QuotaLimitsInput
from tests.builders import make_node, token_client
from tests.claim_builders import allocated, claim, device_request, published
from tests.dashboard.builders import signed_in
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db

REASON = (
    "0/2 nodes are available: 2 cannot allocate all claims. still not schedulable, "
    "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling."
)


def waiting_pod(claim_entry: dict[str, str]) -> dict[str, Any]:
    pod = pod_json("p", "team-a", "uid-p", containers=[gpu_container("main")])
    pod["spec"]["resourceClaims"] = [{"name": "gpu", **claim_entry}]
    pod["status"] = {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": REASON}],
    }  # fmt: skip
    return pod


@pytest.fixture
def dra(fake_kube) -> Any:
    """Two nodes of one 24 GiB card each, 16 GiB and 12 GiB of them allocated; a pod whose
    template made claim p-gpu asking 20 GiB, which fits nowhere."""
    make_node("n1", cards=1, memory_mib=24576)
    fake_kube.resource_slices = published("n1", [24576]) + published("n2", [24576])
    fake_kube.claims = [
        allocated("a", "team-b", "n1", "gpu-0", 16384, 10),
        allocated("b", "team-b", "n2", "gpu-0", 12288, 10),
        claim("p-gpu", "team-a", device_request(memory="20Gi", compute="30"), uid="uid-c"),
    ]
    pod = waiting_pod({"resourceClaimTemplateName": "gpu-20gi"})
    pod["status"]["resourceClaimStatuses"] = [{"name": "gpu", "resourceClaimName": "p-gpu"}]
    fake_kube.add(pod)
    return fake_kube


def test_the_api_answers_for_a_pod_whose_claim_fits_nowhere(dra) -> None:
    response = token_client("vera", Role.VIEWER).get("/api/v1/pods/team-a/p/why")
    assert response.status_code == 200
    body = response.json()
    assert (body["outcome"], body["pod_uid"], body["scheduler_reason"]) == (
        "unschedulable", "uid-p", REASON,
    )  # fmt: skip
    (answer,) = body["claims"]
    assert answer["name"] == "p-gpu" and answer["allocated"] is False
    (request,) = answer["requests"]
    assert (request["memory_mib"], request["compute"], request["fitting"]) == (20480, 30, 0)
    assert [(c["node"], c["free_memory_mib"]) for c in request["closest"]] == [
        ("n2", 12288), ("n1", 8192),
    ]  # fmt: skip
    assert request["to_fit"] == (
        "ask at most 12288 MiB, or wait until claims on gpu-0 (GPU-n2-0) on node n2 free 8192 MiB"
    )
    assert body["summary"].startswith(f"Pending. The scheduler says: {REASON} Claim p-gpu is ")


def test_kubectl_tessera_why_shows_the_closest_cards_and_the_fix(dra) -> None:
    body = token_client("vera", Role.VIEWER).get("/api/v1/pods/team-a/p/why").json()
    text = why_table(body)
    assert f"Scheduler: {REASON}" in text
    assert "Claim p-gpu: not allocated" in text
    assert "Request gpu: 1 x 20480 MiB, 30% compute; 0 of 2 card(s) fit" in text
    assert "12288/24576" in text and "To fit: ask at most 12288 MiB" in text


def test_the_dashboards_pod_page_gives_the_same_answer(dra) -> None:
    page = signed_in(Role.VIEWER).get("/pods/team-a/p/")
    assert page.status_code == 200
    body = page.content.decode()
    assert "The scheduler says: 0/2 nodes are available" in body
    assert "Claim p-gpu, request gpu: the closest cards" in body
    assert "To fit: ask at most 12288 MiB" in body


def test_the_quota_in_the_way_is_named(dra) -> None:
    quotas.set_quota("team-a", QuotaLimitsInput(gpumem_mib=16384), "test")
    (answer,) = token_client("vera", Role.VIEWER).get("/api/v1/pods/team-a/p/why").json()["claims"]
    assert answer["quota"] == (
        "namespace team-a is over its GPU quota: "
        "GPU memory: 0 MiB used + 20480 MiB requested > 16384 MiB limit"
    )


def test_a_claim_not_made_yet_and_a_bound_pod(fake_kube) -> None:
    fake_kube.add(waiting_pod({"resourceClaimTemplateName": "gpu-20gi"}))
    body = token_client("vera", Role.VIEWER).get("/api/v1/pods/team-a/p/why").json()
    (answer,) = body["claims"]
    assert "has not made its claim from ResourceClaimTemplate gpu-20gi yet" in answer["error"]
    fake_kube.pods[("team-a", "p")]["spec"]["nodeName"] = "n1"
    body = token_client("vera", Role.VIEWER).get("/api/v1/pods/team-a/p/why").json()
    assert body["outcome"] == "bound" and "bound on node n1" in body["summary"]


def test_without_an_api_server_an_unknown_pod_is_still_a_404(monkeypatch) -> None:
    def no_credentials() -> None:
        raise RuntimeError("Service host/port is not set.")

    monkeypatch.setattr(adapter, "get_kube", no_credentials)
    response = token_client("vera", Role.VIEWER).get("/api/v1/pods/team-a/p/why")
    assert response.status_code == 404
    assert "could not be read: no API server to ask (RuntimeError)" in response.json()["error"]
    assert signed_in(Role.VIEWER).get("/pods/team-a/p/").status_code == 404
