"""DRA mode on the real node: the chart with `mode: dra` → the node plugin DaemonSet as a kubelet
DRA plugin → its ResourceSlices → the real kube-scheduler allocates a claim's consumed capacity
→ the real kubelet calls NodePrepareResources → the CDI spec → containerd → the shim.

Each pod runs images/gpu-test's probe (as in test_real_node.py): inside its container the shim
must report the claim's memory as the card's total and refuse an allocation past it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import objects
from e2e.dra import WEBHOOK_API, register_claim_webhook
from e2e.node import NODE_LABEL, NODE_NAME, RealNodeCluster
from nodeplugin.dra_slices import DRIVER, slice_name
from tests.deploy.chart import CHART, run_helm
from tests.realnode.conftest import CARDS, NAMESPACE, RELEASE, before_install, chart_values
from tests.realnode.test_real_node import CUDA_ERROR_OUT_OF_MEMORY, running, wait_report

GROUP, VERSION = "resource.k8s.io", "v1"
CLAIMS = f"/apis/{GROUP}/{VERSION}"


@pytest.fixture(scope="module")
def dra_installed(
    node_cluster: RealNodeCluster, core: Any, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """`helm install` with `mode: dra` and the real node's kubelet directories; waits until the
    node plugin published the node's ResourceSlice."""
    gpu_root, gpu_env, _ = before_install(node_cluster, core)
    values = chart_values(node_cluster, gpu_env, gpu_root)
    values["mode"] = "dra"
    plugin = values["nodeplugin"]
    plugin["hostPaths"]["pluginsRegistry"] = str(node_cluster.kubelet_root / "plugins_registry")
    plugin["hostPaths"]["plugins"] = str(node_cluster.kubelet_root / "plugins")
    # No Service network on the node: the API server on its loopback address.
    plugin["extraEnv"]["TESSERA_KUBE_API_URL"] = node_cluster.apiserver_url
    path = node_cluster.node_dir / "chart-values-dra.yaml"
    path.write_text(yaml.safe_dump(values))
    home = tmp_path_factory.mktemp("helm")
    run_helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--values", str(path),
             "--kubeconfig", str(node_cluster.kubeconfig), home=home)  # fmt: skip
    api = objects.Api(node_cluster)
    # The chart's claim webhook names the control plane's Service, which nothing serves here:
    # the same registration, pointed at the harness's control plane, which plays the chart's.
    for config in api.get(WEBHOOK_API)["items"]:
        if any((h.get("clientConfig") or {}).get("service") for h in config["webhooks"]):
            register_claim_webhook(
                node_cluster, api, [{**config, "kind": "ValidatingWebhookConfiguration"}]
            )
            api.delete(f"{WEBHOOK_API}/{config['metadata']['name']}")
    objects.wait_for(
        lambda: published(api),
        timeout=180,
        every=1,
        what=f"the node plugin's ResourceSlice {slice_name(NODE_NAME)}",
    )
    return {"api": api, "state": node_cluster.node_dir / "plugin-state"}


def published(api: objects.Api) -> dict[str, Any] | None:
    found = api.get(f"{CLAIMS}/resourceslices?fieldSelector=spec.nodeName%3D{NODE_NAME}")
    items = found.get("items") or []
    return items[0] if items and len(items[0]["spec"].get("devices") or []) == len(CARDS) else None


@pytest.fixture
def namespace(core: Any, dra_installed: dict[str, Any], request: pytest.FixtureRequest) -> str:
    name = objects.unique(request.node.name.replace("_", "-")[:30].strip("-").lower())
    return objects.create_namespace(core, name, webhook=False)


def template(name: str, memory_mib: int, compute: int, card: int | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {
        "deviceClassName": DRIVER,
        "capacity": {"requests": {"memory": f"{memory_mib}Mi", "compute": str(compute)}},
    }
    if card is not None:
        expression = f'device.attributes["{DRIVER}"].index == {card}'
        request["selectors"] = [{"cel": {"expression": expression}}]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}},
    }


def probe_pod(
    cluster: RealNodeCluster, name: str, template_name: str, memory_mib: int
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {NODE_LABEL: "true"},
            "hostNetwork": True,  # no CNI on the node
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template_name}],
            "containers": [
                {
                    "name": "app",
                    "image": cluster.image_ref("gpu-test"),
                    "args": [
                        f"--inside={memory_mib // 2}",
                        f"--beyond={memory_mib + 1}",
                        f"--card-mib={CARDS[0].memory_mib}",
                        "--sleep",
                    ],
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }


def create(api: objects.Api, namespace: str, doc: dict[str, Any]) -> None:
    kind = "pods" if doc["kind"] == "Pod" else "resourceclaimtemplates"
    base = "/api/v1" if doc["kind"] == "Pod" else CLAIMS
    api.post(f"{base}/namespaces/{namespace}/{kind}", doc)


def claim_of(api: objects.Api, namespace: str, pod: str) -> dict[str, Any] | None:
    got = api.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
    for status in got.get("status", {}).get("resourceClaimStatuses") or []:
        if status.get("resourceClaimName"):
            claim: dict[str, Any] = api.get(
                f"{CLAIMS}/namespaces/{namespace}/resourceclaims/{status['resourceClaimName']}"
            )
            return claim if claim.get("status", {}).get("allocation") else None
    return None


def checkpoint(state: Path) -> dict[str, Any]:
    path = state / "dra" / "claims.json"
    claims: dict[str, Any] = json.loads(path.read_text())["claims"] if path.exists() else {}
    return claims


def start(
    cluster: RealNodeCluster, api: objects.Api, core: Any, namespace: str, name: str,
    template_name: str, memory_mib: int,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Create the probe pod, wait until it runs; its claim and its probe's report."""
    create(api, namespace, probe_pod(cluster, name, template_name, memory_mib))
    objects.wait_for(lambda: running(core, namespace, name), timeout=120, every=0.5,
                     what=f"{namespace}/{name} Running on the real node")  # fmt: skip
    claim = objects.wait_for(lambda: claim_of(api, namespace, name), timeout=30, what="its claim")
    (report,) = wait_report(cluster, namespace, name)[-1:]
    return claim, report


def start_with_template(
    cluster: RealNodeCluster, api: objects.Api, core: Any, namespace: str, name: str,
    memory_mib: int, compute: int,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """A template of its own for the pod, then the pod started: its claim and its report."""
    create(api, namespace, template(f"{name}-gpu", memory_mib, compute))
    return start(cluster, api, core, namespace, name, f"{name}-gpu", memory_mib)


def check_the_shim_holds_the_claim(
    report: dict[str, Any], card: str, memory_mib: int, compute: int
) -> None:
    env = report["env"]
    assert env.get("NVIDIA_VISIBLE_DEVICES") == card
    assert env.get("TESSERA_DEVICE_MEMORY_LIMIT_0") == str(memory_mib)
    assert env.get("TESSERA_DEVICE_CORE_LIMIT_0") == str(compute)
    assert report["shim_mapped"] is True
    assert report["total_mib"] == memory_mib  # the shim reports the claim as the total
    assert report["inside"] == 0
    assert report["beyond"] == CUDA_ERROR_OUT_OF_MEMORY


def delete_and_check_unprepared(
    core: Any, namespace: str, pod: str, spec: Path, state: Path, uid: str
) -> None:
    """Deleting the pod unprepares its claim: the CDI spec and the checkpoint entry go."""
    core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    # The spec goes first, then the checkpoint entry (ClaimPreparer.unprepare).
    objects.wait_for(
        lambda: not spec.exists() and uid not in checkpoint(state),
        timeout=60,
        what="the claim unprepared",
    )


def test_a_claim_is_allocated_prepared_and_enforced_then_unprepared(
    node_cluster: RealNodeCluster, core: Any, dra_installed: dict[str, Any], namespace: str
) -> None:
    api = dra_installed["api"]
    claim, report = start_with_template(node_cluster, api, core, namespace, "train", 4096, 30)
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (DRIVER, NODE_NAME)
    assert result["consumedCapacity"] == {"memory": "4Gi", "compute": "30", "slots": "1"}
    card = CARDS[int(result["device"].removeprefix("gpu-"))].uuid
    check_the_shim_holds_the_claim(report, card, 4096, 30)
    uid = claim["metadata"]["uid"]
    assert set(checkpoint(dra_installed["state"])) == {uid}
    spec = node_cluster.cdi_dir / f"tessera.io_gpu-claim-{uid}.json"
    assert spec.exists()

    delete_and_check_unprepared(core, namespace, "train", spec, dra_installed["state"], uid)


def test_three_claims_share_a_card_and_a_fourth_waits_saying_why(
    node_cluster: RealNodeCluster, core: Any, dra_installed: dict[str, Any], namespace: str
) -> None:
    api = dra_installed["api"]
    create(api, namespace, template("card-0", 2048, 30, card=0))
    shares = set()
    for i in range(3):
        claim, report = start(node_cluster, api, core, namespace, f"share-{i}", "card-0", 2048)
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["device"] == "gpu-0"
        shares.add(result["shareID"])
        check_the_shim_holds_the_claim(report, CARDS[0].uuid, 2048, 30)
    assert len(shares) == 3
    create(api, namespace, probe_pod(node_cluster, "share-3", "card-0", 2048))

    def refused() -> str:
        events = core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=share-3,reason=FailedScheduling"
        ).items
        return " ".join(e.message for e in events)

    message = objects.wait_for(refused, timeout=60, what="share-3's FailedScheduling event")
    assert "cannot allocate all claims" in message, message
    assert not core.read_namespaced_pod("share-3", namespace).spec.node_name


def test_a_prepared_claim_survives_plugin_and_kubelet_restarts_prepared_once(
    node_cluster: RealNodeCluster, core: Any, dra_installed: dict[str, Any], namespace: str
) -> None:
    from tests.realnode.test_real_node import plugin_pod

    api = dra_installed["api"]
    claim, _ = start_with_template(node_cluster, api, core, namespace, "steady", 2048, 10)
    uid = claim["metadata"]["uid"]
    spec = node_cluster.cdi_dir / f"tessera.io_gpu-claim-{uid}.json"
    container = core.read_namespaced_pod("steady", namespace).status.container_statuses[0]

    old = plugin_pod(core)
    core.delete_namespaced_pod(old.metadata.name, NAMESPACE)
    objects.wait_for(
        lambda: (p := plugin_pod(core)) is not None and p.metadata.uid != old.metadata.uid
        and p.status.phase == "Running",
        timeout=120, every=1, what="the DaemonSet's new node plugin",
    )  # fmt: skip
    node_cluster.restart_kubelet()
    # A pod started after both restarts is prepared by the new plugin through the new kubelet.
    start_with_template(node_cluster, api, core, namespace, "after", 1024, 10)

    assert list(checkpoint(dra_installed["state"])).count(uid) == 1 and spec.exists()
    now = core.read_namespaced_pod("steady", namespace).status.container_statuses[0]
    assert (now.container_id, now.restart_count) == (container.container_id, 0)
    delete_and_check_unprepared(core, namespace, "steady", spec, dra_installed["state"], uid)
