"""A pod written for HAMi runs unchanged in DRA mode on the real node: `nvidia.com/gpu: 1`,
`nvidia.com/gpumem: 4096`, `nvidia.com/gpucores: 30`, no claim written. The control plane's
webhook, in DRA mode (`TESSERA_MODE=dra`), gives it a ResourceClaimTemplate and points it at it;
kube-controller-manager makes the pod's claim; the real kube-scheduler allocates it from the
node plugin's ResourceSlice; the real kubelet prepares it; the shim holds the container to
4096 MiB (images/gpu-test's probe: the card's total is the claim's, past it is refused).

The cluster is this module's own: the harness's control plane (which plays the chart's) runs in
DRA mode here, while test_dra_real_node.py's runs in extender mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from controlplane.extender.dra_translate import POD_CLAIM_PREFIX, TEMPLATE_PREFIX
from e2e import objects
from e2e.harness import run_folder
from e2e.node import NODE_NAME, RealNodeCluster
from nodeplugin.dra_slices import DRIVER
from tests.realnode.conftest import CARDS, RELEASE, running_harness
from tests.realnode.test_dra_real_node import (
    CLAIMS,
    check_the_shim_holds_the_claim,
    checkpoint,
    claim_of,
    delete_and_check_unprepared,
    dra_installed,
    probe_pod,
)
from tests.realnode.test_real_node import running, wait_report

__all__ = ["dra_installed"]  # the fixture, used here as test_dra_real_node.py uses it


@pytest.fixture(scope="module")
def node_cluster() -> Iterator[RealNodeCluster]:
    """The real-node harness with its control plane in DRA mode."""
    # A short folder name: the kubelet's plugin sockets live under it, and a unix socket's
    # path holds at most 107 bytes.
    yield from running_harness(
        run_dir=run_folder("run-rnh"), controlplane_env={"TESSERA_MODE": "dra"}
    )


@pytest.fixture(scope="module")
def hami_ready(kube: Any, dra_installed: dict[str, Any]) -> dict[str, Any]:
    """The chart in DRA mode, less its own webhook registration, which names a Service nothing
    serves here (the harness registers its control plane's for the same pods)."""
    from kubernetes import client

    client.AdmissionregistrationV1Api(kube).delete_mutating_webhook_configuration(
        f"{RELEASE}-dra-pods"
    )
    return dra_installed


def hami_pod(cluster: RealNodeCluster, name: str, memory_mib: int, cores: int) -> dict[str, Any]:
    """The probe pod as a HAMi user writes it: HAMi's resources, no claim, no scheduler named."""
    pod = probe_pod(cluster, name, "", memory_mib)
    del pod["spec"]["resourceClaims"]
    pod["spec"]["containers"][0]["resources"] = {
        "limits": {
            "nvidia.com/gpu": "1",
            "nvidia.com/gpumem": str(memory_mib),
            "nvidia.com/gpucores": str(cores),
        }
    }
    return pod


def test_a_hami_pod_gets_its_claim_and_runs_held_to_its_slice(
    node_cluster: RealNodeCluster, core: Any, hami_ready: dict[str, Any]
) -> None:
    api = hami_ready["api"]
    namespace = objects.create_namespace(core, objects.unique("hami-pod"))  # webhook on
    api.post(f"/api/v1/namespaces/{namespace}/pods", hami_pod(node_cluster, "hami", 4096, 30))

    served = core.read_namespaced_pod("hami", namespace)
    (entry,) = served.spec.resource_claims
    assert entry.name == f"{POD_CLAIM_PREFIX}0"
    assert entry.resource_claim_template_name.startswith(TEMPLATE_PREFIX)
    (app,) = served.spec.containers
    assert not any(k.startswith("nvidia.com/") for k in (app.resources.limits or {}))
    assert [(c.name, c.request) for c in app.resources.claims] == [(entry.name, "app")]
    template = api.get(
        f"{CLAIMS}/namespaces/{namespace}/resourceclaimtemplates/"
        f"{entry.resource_claim_template_name}"
    )
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == DRIVER

    objects.wait_for(lambda: running(core, namespace, "hami"), timeout=120, every=0.5,
                     what=f"{namespace}/hami Running on the real node")  # fmt: skip
    claim = objects.wait_for(lambda: claim_of(api, namespace, "hami"), timeout=30, what="its claim")
    # the claim controller made it from the template, owned by the pod
    (owner,) = claim["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Pod", "hami", served.metadata.uid)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["request"]) == (DRIVER, NODE_NAME, "app")
    assert result["consumedCapacity"] == {"memory": "4Gi", "compute": "30", "slots": "1"}
    card = CARDS[int(result["device"].removeprefix("gpu-"))].uuid
    (report,) = wait_report(node_cluster, namespace, "hami")[-1:]
    check_the_shim_holds_the_claim(report, card, 4096, 30)

    uid = claim["metadata"]["uid"]
    assert uid in checkpoint(hami_ready["state"])
    spec = node_cluster.cdi_dir / f"tessera.io_gpu-claim-{uid}.json"
    delete_and_check_unprepared(core, namespace, "hami", spec, hami_ready["state"], uid)
