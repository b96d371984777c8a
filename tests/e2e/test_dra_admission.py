"""DRA mode on the real cluster: Tessera's namespace quotas at admission of claims, and
why-pending for a pod whose claim fits nowhere (docs/dra.md, *Quotas at admission*, *Why a
claim waits*).

Set up as tests/e2e/test_dra.py (the claim controller, the chart's DeviceClasses, a kwok node
with the slices the node plugin would publish); the chart's ValidatingWebhookConfiguration of
DRA mode is registered as rendered, pointed at the harness's control plane, whose webhook reads
the claims and templates from this API server.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from e2e import objects
from e2e.cluster import Cluster
from e2e.dra import (
    CLAIM_CONTROLLER,
    publish_kwok_slices,
    register_claim_webhook,
    start_claim_controller,
    unregister_claim_webhook,
)
from nodeplugin.dra_slices import DRIVER

POOL = "dra-admission"
NODE = "gpu-e2e-dra-admission"
CARD_MIB = 24576
RESOURCE_API = "/apis/resource.k8s.io/v1"


def device_request(memory: str, compute: str = "10") -> dict[str, Any]:
    return {
        "name": "gpu",
        "exactly": {
            "deviceClassName": DRIVER,
            "capacity": {"requests": {"memory": memory, "compute": compute}},
        },
    }


def claim(name: str, memory: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [device_request(memory)]}},
    }


def template(name: str, memory: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [device_request(memory)]}}},
    }


def pod(name: str, template_name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {objects.POOL_LABEL: POOL},
            "tolerations": [{"operator": "Exists"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template_name}],
            "containers": [
                {"name": "main", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }


def create(api: objects.Api, namespace: str, doc: dict[str, Any]) -> requests.Response:
    """POST the object; the answer as it is (a refusal is what several tests look for)."""
    kind = doc["kind"]
    path = (
        f"/api/v1/namespaces/{namespace}/pods"
        if kind == "Pod"
        else f"{RESOURCE_API}/namespaces/{namespace}/{kind.lower()}s"
    )
    return api.session().post(f"{api.base}{path}", json=doc, timeout=60)


@pytest.fixture(scope="module")
def dra(cluster: Cluster, core: Any, kube: Any) -> Iterator[objects.Api]:
    """The claim controller, the DeviceClasses, a kwok node of one 24 GiB card with its
    slices, and the chart's claim webhook pointed at this control plane."""
    from kubernetes import client, dynamic

    from tests.deploy.chart import render

    start_claim_controller(cluster)
    resources = dynamic.DynamicClient(kube).resources
    docs = render(sets=("mode=dra",))
    for doc in docs:
        if doc["kind"] == "DeviceClass":
            classes = resources.get(api_version=doc["apiVersion"], kind="DeviceClass")
            with contextlib.suppress(client.ApiException):  # a rerun on a kept cluster
                classes.create(body=doc)
    with contextlib.suppress(client.ApiException):
        core.create_node(objects.gpu_node(NODE, cards=1, pool=POOL))
    api = objects.Api(cluster)
    with contextlib.suppress(RuntimeError):  # already published on a kept cluster
        publish_kwok_slices(api, [NODE], cards=1, memory_mib=CARD_MIB, slots=4)
    webhook = register_claim_webhook(cluster, api, docs)
    try:
        yield api
    finally:
        unregister_claim_webhook(api, webhook)
        cluster.stop_component(CLAIM_CONTROLLER)


@pytest.fixture
def namespace(core: Any, tessera: objects.Tessera) -> str:
    """A namespace whose Tessera quota is 8 GiB of GPU memory."""
    name = objects.create_namespace(core, objects.unique("dra-quota"), webhook=False)
    answer = tessera.put(
        f"/api/v1/quotas/{name}/", {"namespace": name, "gpumem_mib": 8192, "gpus": 4}
    )
    assert answer.status_code in (200, 201), answer.text
    return name


def refused_until_live(api: objects.Api, namespace: str, doc: dict[str, Any]) -> str:
    """The refusal's message; the API server takes a moment to start calling a webhook just
    registered, so an early create that passes is deleted and tried again (for at most 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        answer = create(api, namespace, doc)
        if answer.status_code == 403 or time.monotonic() > deadline:
            break
        kind = doc["kind"].lower() + "s"
        base = "/api/v1" if doc["kind"] == "Pod" else RESOURCE_API
        api.session().delete(
            f"{api.base}{base}/namespaces/{namespace}/{kind}/{doc['metadata']['name']}", timeout=60
        )
        time.sleep(1)
    assert answer.status_code == 403, answer.text
    return str(answer.json()["message"])


def listed(api: objects.Api, path: str) -> list[str]:
    return [i["metadata"]["name"] for i in api.get(path)["items"]]


def test_a_claim_over_its_namespaces_quota_is_refused_naming_the_quota(
    dra: objects.Api, namespace: str
) -> None:
    message = refused_until_live(dra, namespace, claim("too-big", "10Gi"))
    assert f"namespace {namespace} is over its GPU quota" in message
    assert "GPU memory: 0 MiB used + 10240 MiB requested > 8192 MiB limit" in message
    # nothing was created
    assert listed(dra, f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims") == []


def test_a_claim_within_the_quota_is_admitted_and_then_counts(
    dra: objects.Api, namespace: str
) -> None:
    refused_until_live(dra, namespace, claim("probe", "9Gi"))
    assert create(dra, namespace, claim("fits", "6Gi")).status_code == 201
    # the claim is not allocated (no pod uses it), so the ledger has not mirrored it: it
    # counts from the API server's list, and a second one past the limit is refused
    answer = create(dra, namespace, claim("second", "4Gi"))
    assert answer.status_code == 403, answer.text
    message = answer.json()["message"]
    assert "GPU memory: 6144 MiB used + 4096 MiB requested > 8192 MiB limit" in message
    assert "1 claim(s) not yet in Tessera's ledger" in message
    assert listed(dra, f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims") == ["fits"]


def test_a_pod_whose_template_would_exceed_the_quota_is_refused(
    dra: objects.Api, namespace: str
) -> None:
    assert create(dra, namespace, template("big", "12Gi")).status_code == 201
    message = refused_until_live(dra, namespace, pod("trainer", "big"))
    assert f"namespace {namespace} is over its GPU quota" in message
    assert "12288 MiB requested > 8192 MiB limit" in message
    assert "ResourceClaimTemplate big" in message
    assert listed(dra, f"/api/v1/namespaces/{namespace}/pods") == []


def test_why_pending_answers_for_a_pod_whose_claim_fits_nowhere(
    dra: objects.Api, core: Any, tessera: objects.Tessera
) -> None:
    namespace = objects.create_namespace(core, objects.unique("dra-why"), webhook=False)
    # larger than any card the kwok nodes publish (80 GiB the largest): it fits nowhere
    assert create(dra, namespace, template("huge", "100Gi")).status_code == 201
    assert create(dra, namespace, pod("waiting", "huge")).status_code == 201
    deadline = time.monotonic() + 90
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        answer = tessera.why(namespace, "waiting")
        body = answer.json() if answer.status_code == 200 else {}
        claims = body.get("claims") or []
        if body.get("scheduler_reason") and claims and claims[0].get("requests"):
            break
        time.sleep(1)
    assert "cannot allocate all claims" in body["scheduler_reason"], body
    (answer,) = body["claims"]
    assert answer["allocated"] is False
    (request,) = answer["requests"]
    assert request["memory_mib"] == 102400 and request["fitting"] == 0
    closest = request["closest"][0]
    assert closest["uuid"].startswith("GPU-") and closest["free_memory_mib"] < 102400
    # what would make it fit: at most the largest free memory of a card, or room on the closest
    most = int(request["to_fit"].removeprefix("ask at most ").split(" ", 1)[0])
    assert closest["free_memory_mib"] <= most < 102400
    assert f"or wait until claims on {closest['device']} ({closest['uuid']})" in request["to_fit"]
    assert body["outcome"] == "unschedulable"
    assert "Claim " in body["summary"] and "To fit: ask at most" in body["summary"]
