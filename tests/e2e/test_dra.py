"""DRA mode on the real cluster: kube-scheduler allocates Tessera's cards from ResourceSlices.

Kwok nodes of their own carry the slices the node plugin would publish for their cards
(e2e/dra.py, built by the plugin's own builder), the chart's DeviceClasses are applied as
rendered, and kube-controller-manager's ResourceClaim controller makes each pod's claim from its
ResourceClaimTemplate. No extender takes part: pods go to the default scheduler, which allocates
with consumable capacity (docs/dra.md). What a claim got is read from its status.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from e2e import objects
from e2e.cluster import Cluster
from e2e.dra import CLAIM_CONTROLLER, publish_kwok_slices, start_claim_controller
from nodeplugin.dra_slices import DRIVER

POOL = "dra"
NODES = ["gpu-e2e-dra-0", "gpu-e2e-dra-1"]  # two cards each
ONE_CARD = "gpu-e2e-dra-one"  # the sharing test's node: one card
GROUP, VERSION = "resource.k8s.io", "v1"


@pytest.fixture(scope="module")
def dra(cluster: Cluster, core: Any, kube: Any) -> Iterator[objects.Api]:
    """The claim controller, the chart's DeviceClasses and the kwok nodes with their slices."""
    from kubernetes import client, dynamic

    from tests.deploy.chart import render

    start_claim_controller(cluster)
    resources = dynamic.DynamicClient(kube).resources
    for doc in render(sets=("mode=dra",)):
        if doc["kind"] == "DeviceClass":
            classes = resources.get(api_version=doc["apiVersion"], kind="DeviceClass")
            with contextlib.suppress(client.ApiException):  # a rerun on a kept cluster
                classes.create(body=doc)
    for name in NODES:
        core.create_node(objects.gpu_node(name, cards=2, pool=POOL))
    core.create_node(objects.gpu_node(ONE_CARD, cards=1, pool=f"{POOL}-one"))
    api = objects.Api(cluster)
    assert publish_kwok_slices(api, NODES, cards=2, slots=10) == len(NODES)
    assert publish_kwok_slices(api, [ONE_CARD], cards=1, slots=10) == 1
    try:
        yield api
    finally:
        cluster.stop_component(CLAIM_CONTROLLER)


def template(
    name: str,
    *,
    memory: str = "4Gi",
    compute: str = "30",
    device_class: str = DRIVER,
) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": device_class,
                                "capacity": {"requests": {"memory": memory, "compute": compute}},
                            },
                        }
                    ]
                }
            }
        },
    }


def pod(name: str, template_name: str, pool: str = POOL) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {objects.POOL_LABEL: pool},
            "tolerations": [{"operator": "Exists"}],
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template_name}],
            "containers": [
                {"name": "main", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }


@pytest.fixture
def namespace(core: Any) -> str:
    return objects.create_namespace(core, objects.unique("dra"), webhook=False)


def create(api: objects.Api, namespace: str, doc: dict[str, Any]) -> Any:
    if doc["kind"] == "Pod":
        return api.post(f"/api/v1/namespaces/{namespace}/pods", doc)
    return api.post(f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/resourceclaimtemplates", doc)


def claim_of(api: objects.Api, namespace: str, pod_name: str) -> dict[str, Any] | None:
    """The claim the controller made for the pod's `gpu` entry, once allocated."""
    got = api.get(f"/api/v1/namespaces/{namespace}/pods/{pod_name}")
    for status in got.get("status", {}).get("resourceClaimStatuses") or []:
        if status["name"] == "gpu" and status.get("resourceClaimName"):
            path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/resourceclaims/"
            claim: dict[str, Any] = api.get(path + status["resourceClaimName"])
            return claim if claim.get("status", {}).get("allocation") else None
    return None


def unschedulable(api: objects.Api, namespace: str, pod_name: str) -> str:
    """The pod's PodScheduled=False message once the scheduler gave up on it, else ''."""
    got = api.get(f"/api/v1/namespaces/{namespace}/pods/{pod_name}")
    assert not got["spec"].get("nodeName"), f"{pod_name} was bound to {got['spec']['nodeName']}"
    for c in got.get("status", {}).get("conditions") or []:
        if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message"):
            return str(c["message"])
    return ""


def test_a_claim_from_a_template_is_allocated_consumed_capacity_and_bound_on_a_kwok_node(
    dra: objects.Api, core: Any, namespace: str
) -> None:
    create(dra, namespace, template("gpu-4gi-30", memory="4Gi", compute="30"))
    create(dra, namespace, pod("train", "gpu-4gi-30"))
    running = objects.wait_running(core, namespace, "train", timeout=60)
    assert running.spec.node_name in NODES
    claim = objects.wait_for(
        lambda: claim_of(dra, namespace, "train"), timeout=30, what="the claim's allocation"
    )
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (DRIVER, running.spec.node_name)
    assert result["device"] in ("gpu-0", "gpu-1")
    assert result["consumedCapacity"] == {"memory": "4Gi", "compute": "30", "slots": "1"}
    assert result["shareID"]
    reserved = [r["name"] for r in claim["status"].get("reservedFor") or []]
    assert reserved == ["train"]


def test_three_claims_share_one_card_and_a_fourth_that_does_not_fit_waits(
    dra: objects.Api, core: Any, namespace: str
) -> None:
    create(dra, namespace, template("gpu-30", memory="8Gi", compute="30"))
    for i in range(3):
        create(dra, namespace, pod(f"share-{i}", "gpu-30", pool=f"{POOL}-one"))
    shares = set()
    for i in range(3):
        assert objects.wait_running(core, namespace, f"share-{i}").spec.node_name == ONE_CARD
        claim = objects.wait_for(
            lambda i=i: claim_of(dra, namespace, f"share-{i}"), timeout=30, what="an allocation"
        )
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["pool"], result["device"]) == (ONE_CARD, "gpu-0")
        shares.add(result["shareID"])
    assert len(shares) == 3  # three allocations of one device, each its own share
    # 90 % of the compute is taken: a fourth 30 % claim does not fit the card.
    create(dra, namespace, pod("share-3", "gpu-30", pool=f"{POOL}-one"))
    message = objects.wait_for(
        lambda: unschedulable(dra, namespace, "share-3"), timeout=30, what="share-3 refused"
    )
    assert "cannot allocate all claims" in message, message


@pytest.mark.parametrize(
    ("ask", "reason"),
    [
        ({"memory": "90Gi"}, "cannot allocate all claims"),  # more than a card has
        ({"compute": "101"}, "cannot allocate all claims"),  # past the request policy's max
        ({"device_class": "nope.gpu.tessera.io"}, "nope.gpu.tessera.io"),
    ],
    ids=["memory-beyond-the-card", "compute-beyond-the-policy", "unknown-device-class"],
)
def test_what_no_card_can_serve_stays_pending_with_the_reason(
    dra: objects.Api, core: Any, namespace: str, ask: dict[str, str], reason: str
) -> None:
    create(dra, namespace, template("bad", **ask))
    create(dra, namespace, pod("bad", "bad"))
    message = objects.wait_for(
        lambda: unschedulable(dra, namespace, "bad"), timeout=30, what="the refusal"
    )
    assert reason in message, message
