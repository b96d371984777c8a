"""`POST /webhook/validate-claims` (DRA mode): ResourceClaims and pods with claim templates held
to Tessera's namespace quotas at admission, usage counted from the ledger's pod and claim rows
and from the claims the API server holds that the ledger has not mirrored yet."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.kube import base as kube
from controlplane.ledger.services import quotas
from controlplane.ledger.services.quotas import QuotaLimitsInput
from tests.builders import make_node
from tests.claim_builders import claim, device_request, template
from tests.dashboard.builders import pod
from tests.extender.conftest import post
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db

PATH = "/webhook/validate-claims"


def review(obj: dict[str, Any], kind: str, operation: str = "CREATE") -> dict[str, Any]:
    group, version = ("resource.k8s.io", "v1") if kind == "ResourceClaim" else ("", "v1")
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "b1c2",
            "kind": {"group": group, "version": version, "kind": kind},
            "namespace": obj["metadata"]["namespace"],
            "operation": operation,
            "object": obj,
        },
    }


def validate(client, obj: dict[str, Any], kind: str = "ResourceClaim", **kw: Any) -> dict:
    response = post(client, PATH, review(obj, kind, **kw))
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["response"]["uid"] == "b1c2"
    return body["response"]


def claim_pod(name: str, namespace: str, *entries: dict[str, str]) -> dict[str, Any]:
    body = pod_json(name, namespace, containers=[gpu_container("main")])
    body["spec"]["resourceClaims"] = list(entries)
    return body


@pytest.fixture
def team(fake_kube) -> Any:
    """Namespace team-a: a quota of 20 GiB, 100 % and 3 slices; one pod row (8 GiB, 20 %, 1)
    and one claim row (4 GiB, 30 %, 1) in the ledger, the claim's also in the API server."""
    make_node("n1", cards=4, memory_mib=24576)
    quotas.set_quota("team-a", QuotaLimitsInput(gpumem_mib=20480, gpucores=100, gpus=3), "test")
    pod("trainer", "n1", gpu_container(mem=8192, cores=20), namespace="team-a")
    # A mirrored claim's row: keyed by the claim's UID, one slice per allocated device
    pod("claim-a", "n1", gpu_container(mem=4096, cores=30), namespace="team-a", uid="uid-claim-a")
    fake_kube.claims.append(
        claim("claim-a", "team-a", device_request(memory="4Gi", compute="30"), uid="uid-claim-a")
    )
    return fake_kube


def test_a_claim_within_the_quota_is_admitted(client, team) -> None:
    new = claim("c", "team-a", device_request(memory="8Gi", compute="50"))
    assert validate(client, new)["allowed"] is True


def test_a_claim_over_the_quota_is_refused_naming_the_quota(client, team) -> None:
    new = claim("c", "team-a", device_request(memory="10Gi", compute="10"))
    answer = validate(client, new)
    assert answer["allowed"] is False
    message = answer["status"]["message"]
    # the extender's own words: the namespace, what is used (pod + claim rows), asked, the limit
    assert message.startswith("namespace team-a is over its GPU quota: ")
    assert "GPU memory: 12288 MiB used + 10240 MiB requested > 20480 MiB limit" in message
    assert "GPU compute" not in message
    assert answer["status"]["code"] == 403


def test_unmirrored_claims_count_so_a_burst_cannot_slip_under(client, team) -> None:
    # two claims the API server stored and the reconciler has not mirrored yet: 2 slices
    for name in ("b1", "b2"):
        team.claims.append(claim(name, "team-a", device_request(memory="1Gi"), uid=f"uid-{name}"))
    answer = validate(client, claim("c", "team-a", device_request(memory="1Gi")))
    assert answer["allowed"] is False
    message = answer["status"]["message"]
    assert "GPU slices: 4 used + 1 requested > 3 limit" in message
    assert "2 claim(s) not yet in Tessera's ledger" in message
    # a claim being deleted, or of another namespace or class, counts nothing
    team.claims[1]["metadata"]["deletionTimestamp"] = "2026-12-05T22:00:00Z"
    team.claims[2]["metadata"]["namespace"] = "team-b"
    assert validate(client, claim("c", "team-a", device_request(memory="1Gi")))["allowed"]


def test_no_memory_named_counts_the_whole_smallest_card(client, team) -> None:
    answer = validate(client, claim("c", "team-a", device_request()))
    assert answer["allowed"] is False
    assert "12288 MiB used + 24576 MiB requested" in answer["status"]["message"]


def test_claims_of_other_classes_and_namespaces_without_quota_pass(client, team) -> None:
    other = claim("nic", "team-a", device_request("nic", "sriov.example.com", count=64))
    assert validate(client, other)["allowed"] is True
    free = claim("c", "team-b", device_request(count=8, memory="20Gi"))
    assert validate(client, free)["allowed"] is True


def test_a_bad_claim_spec_is_refused_with_its_field(client, team) -> None:
    answer = validate(client, claim("c", "team-a", device_request(compute="150")))
    assert answer["allowed"] is False
    assert answer["status"]["message"].startswith(
        "spec.devices.requests[0].exactly.capacity.requests.compute: is 150"
    )


def test_a_pod_whose_template_would_exceed_the_quota_is_refused(client, team) -> None:
    team.claim_templates[("team-a", "big")] = template(
        "big", "team-a", device_request(count=2, memory="6Gi", compute="10")
    )
    team.claim_templates[("team-a", "small")] = template(
        "small", "team-a", device_request(memory="2Gi")
    )
    big = claim_pod("p", "team-a", {"name": "gpu", "resourceClaimTemplateName": "big"})
    answer = validate(client, big, "Pod")
    assert answer["allowed"] is False
    message = answer["status"]["message"]
    assert "GPU memory: 12288 MiB used + 12288 MiB requested > 20480 MiB limit" in message
    assert "ResourceClaimTemplate big" in message
    small = claim_pod("p", "team-a", {"name": "gpu", "resourceClaimTemplateName": "small"})
    assert validate(client, small, "Pod")["allowed"] is True
    # a claim named by resourceClaimName exists already: judged when it was created
    named = claim_pod("p", "team-a", {"name": "gpu", "resourceClaimName": "claim-a"})
    assert validate(client, named, "Pod")["allowed"] is True
    # a template that does not exist yet asks nothing Tessera counts
    missing = claim_pod("p", "team-a", {"name": "gpu", "resourceClaimTemplateName": "none"})
    assert validate(client, missing, "Pod")["allowed"] is True


def test_two_templates_of_one_pod_add_up(client, team) -> None:
    team.claim_templates[("team-a", "t")] = template("t", "team-a", device_request(memory="5Gi"))
    both = claim_pod(
        "p", "team-a",
        {"name": "a", "resourceClaimTemplateName": "t"},
        {"name": "b", "resourceClaimTemplateName": "t"},
    )  # fmt: skip
    answer = validate(client, both, "Pod")
    assert answer["allowed"] is False
    assert "12288 MiB used + 10240 MiB requested" in answer["status"]["message"]


def test_only_creates_are_judged(client, team) -> None:
    new = claim("c", "team-a", device_request(memory="100Gi"))
    assert validate(client, new, operation="UPDATE")["allowed"] is True
    assert validate(client, new, operation="DELETE")["allowed"] is True


def test_an_api_server_that_cannot_be_read_fails_the_call(client, team) -> None:
    def down() -> None:
        raise kube.KubeError("list ResourceClaims: API server unreachable", None, False)

    team.fail_claims = down
    response = post(client, PATH, review(claim("c", "team-a", device_request(memory="1Gi")),
                                         "ResourceClaim"))  # fmt: skip
    # a 500 is no verdict: failurePolicy Fail refuses the create
    assert response.status_code == 500
    assert "allowed" not in response.content.decode()


def test_not_an_admission_review_is_a_400_and_get_is_a_405(client) -> None:
    assert post(client, PATH, {"request": {}}).status_code == 400
    assert client.get(PATH).status_code == 405
