"""DRA mode's node plugin against a real kube-apiserver (the e2e harness's, with its DRA gates):
the chart installed with `mode: dra` (its ServiceAccount, RBAC and ValidatingAdmissionPolicy),
and the plugin's own publisher (nodeplugin/dra_publish.py) writing ResourceSlices with a token
bound to a pod on its node, as the DaemonSet's pod gets (docs/dra.md).

No scheduler, controllers or kubelets run here: the API server stores and validates.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.dra import kwok_cards
from nodeplugin.cards import Health
from nodeplugin.dra_publish import SlicePublisher
from nodeplugin.dra_slices import DRIVER, UNHEALTHY_TAINT, build_slices, slice_name
from nodeplugin.kubeapi import KubeApi, KubeApiError
from tests.deploy.chart import CHART, NAMESPACE, RELEASE, render, run_helm
from tests.deploy.test_install import can

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("helm")]

RESOURCE = "/apis/resource.k8s.io/v1"


@pytest.fixture(scope="module")
def kube(apiserver: Any) -> Iterator[Any]:
    with contextlib.closing(apiserver.api_client()) as api:
        yield api


@pytest.fixture(scope="module")
def installed(
    apiserver: Any, kube: Any, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """`helm install` with `mode: dra` into tessera-system; returns the rendered documents.
    Its notes tell the operator how claims are made and where the cards show."""
    from kubernetes import client

    client.CoreV1Api(kube).create_namespace({"metadata": {"name": NAMESPACE}})
    home = tmp_path_factory.mktemp("helm")
    out = run_helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", "mode=dra",
                   "--kubeconfig", str(apiserver.kubeconfig), home=home).stdout  # fmt: skip
    assert "DRA mode: pods ask for GPU slices with ResourceClaims" in out, out
    assert "routed to the" not in out
    return render(sets=("mode=dra",))


def service_account(docs: list[dict[str, Any]]) -> str:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return str(ds["spec"]["template"]["spec"]["serviceAccountName"])


def node_token(kube: Any, sa: str, node: str) -> str:
    """A token of the plugin's ServiceAccount bound to a pod on ``node`` (the projected token
    of the DaemonSet's pod there): it carries the node's name."""
    from kubernetes import client

    core = client.CoreV1Api(kube)
    with contextlib.suppress(client.ApiException):
        core.create_node({"metadata": {"name": node}})
    pod = core.create_namespaced_pod(
        NAMESPACE,
        {
            "metadata": {"name": f"nodeplugin-{node}-{uuid.uuid4().hex[:6]}"},
            "spec": {
                "nodeName": node,
                "serviceAccountName": sa,
                "automountServiceAccountToken": False,
                "containers": [{"name": "nodeplugin", "image": "tessera/nodeplugin:test"}],
            },
        },
    )
    answer = core.create_namespaced_service_account_token(
        sa,
        NAMESPACE,
        {
            "spec": {
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod.metadata.name,
                    "uid": pod.metadata.uid,
                },
            }
        },
    )
    return str(answer.status.token)


def wait_until_enforced(apiserver: Any, token: str, foreign: dict[str, object]) -> None:
    """Admission policies take effect a moment after they are created: wait until a dry-run
    create of another node's slice with ``token`` is refused."""
    import requests

    url = f"{apiserver.apiserver_url}{RESOURCE}/resourceslices?dryRun=All"
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + 30
    while True:
        answer = requests.post(
            url, json=foreign, headers=headers, verify=str(apiserver.pki / "ca.crt"), timeout=10
        )
        if answer.status_code == 422 and "ValidatingAdmissionPolicy" in answer.text:
            return
        assert time.monotonic() < deadline, f"the policy is not enforced: {answer.text[:300]}"
        time.sleep(0.2)


def unbound_token(kube: Any, sa: str) -> str:
    from kubernetes import client

    answer = client.CoreV1Api(kube).create_namespaced_service_account_token(
        sa, NAMESPACE, {"spec": {"expirationSeconds": 3600}}
    )
    return str(answer.status.token)


def plugin_api(apiserver: Any, tmp_path: Path, token: str) -> KubeApi:
    (tmp_path / "token").write_text(token)
    return KubeApi(apiserver.apiserver_url, tmp_path / "token", apiserver.pki / "ca.crt", 10)


def stored(kube: Any, name: str) -> dict[str, Any] | None:
    from kubernetes import client

    try:
        obj: dict[str, Any] = client.CustomObjectsApi(kube).get_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", name
        )
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return obj


def test_the_plugin_publishes_its_nodes_slices_through_the_real_api_server(
    apiserver: Any, kube: Any, installed: list[dict[str, Any]], tmp_path: Path
) -> None:
    node = "dra-node-a"
    cards = kwok_cards(node, 2)
    health: dict[str, Health] = {}
    modes: dict[str, str] = {}
    api = plugin_api(apiserver, tmp_path, node_token(kube, service_account(installed), node))

    def slices_at(generation: int) -> list[dict[str, object]]:
        return build_slices(node, cards, modes=modes, health=health, slots=4, generation=generation)

    async def scenario() -> list[int]:
        publisher = SlicePublisher(api, node, slices_at, resync_s=1)
        await publisher.sync()
        first = stored(kube, slice_name(node))
        assert first is not None
        spec = first["spec"]
        assert (spec["driver"], spec["nodeName"], spec["pool"]["generation"]) == (DRIVER, node, 1)
        # Stored as published: the gate kept the shared cards' consumable capacity.
        device = spec["devices"][0]
        assert device["allowMultipleAllocations"] is True
        assert device["capacity"]["slots"]["requestPolicy"]["validValues"] == ["1"]
        assert device["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "1Mi"
        writes = [publisher.writes]
        await publisher.sync()  # nothing changed: nothing written
        writes.append(publisher.writes)

        health[cards[1].uuid] = Health(False, "XID 79")
        modes[cards[0].uuid] = "exclusive"
        await publisher.sync()
        spec = stored(kube, slice_name(node))["spec"]  # type: ignore[index]
        assert spec["pool"]["generation"] == 2
        assert "allowMultipleAllocations" not in spec["devices"][0]
        (taint,) = spec["devices"][1]["taints"]
        assert (taint["key"], taint["effect"]) == (UNHEALTHY_TAINT, "NoSchedule")
        await publisher.sync()  # the server's defaults (the taint's timeAdded) are no change
        writes.append(publisher.writes)

        # A restarted plugin continues from the stored generation; a deleted slice comes back.
        again = SlicePublisher(api, node, slices_at, resync_s=1)
        from kubernetes import client

        client.CustomObjectsApi(kube).delete_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", slice_name(node)
        )
        await again.sync()
        spec = stored(kube, slice_name(node))["spec"]  # type: ignore[index]
        assert spec["pool"]["generation"] == 1  # none stored: it starts over
        await again.sync()
        writes.append(again.writes)
        third = SlicePublisher(api, node, slices_at, resync_s=1)
        await third.sync()
        assert stored(kube, slice_name(node))["spec"]["pool"]["generation"] == 2  # type: ignore[index]
        return writes

    assert asyncio.run(scenario()) == [1, 1, 2, 1]


def test_a_nodes_plugin_cannot_touch_another_nodes_slices(
    apiserver: Any, kube: Any, installed: list[dict[str, Any]], tmp_path: Path
) -> None:
    sa = service_account(installed)
    mine, other = "dra-node-b", "dra-node-c"
    token = node_token(kube, sa, mine)
    api = plugin_api(apiserver, tmp_path, token)
    theirs = build_slices(other, kwok_cards(other, 1), modes={}, health={}, slots=2, generation=1)
    wait_until_enforced(apiserver, token, theirs[0])

    async def scenario() -> None:
        with pytest.raises(
            KubeApiError, match=f"may only write ResourceSlices of that node, not of {other}"
        ):
            await api.create_resource_slice(dict(theirs[0]))
        assert stored(kube, slice_name(other)) is None
        # One the cluster has (published by that node's own plugin) cannot be deleted either.
        from kubernetes import client

        created = client.CustomObjectsApi(kube).create_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", dict(theirs[0])
        )
        with pytest.raises(KubeApiError, match="may only write ResourceSlices of that node"):
            await api.delete_resource_slice(slice_name(other), created["metadata"]["uid"])
        assert stored(kube, slice_name(other)) is not None
        # A token of the ServiceAccount that no pod holds names no node: refused outright.
        loose = plugin_api(apiserver, tmp_path, unbound_token(kube, sa))
        mine_slices = build_slices(
            mine, kwok_cards(mine, 1), modes={}, health={}, slots=2, generation=1
        )
        with pytest.raises(KubeApiError, match="names no node"):
            await loose.create_resource_slice(dict(mine_slices[0]))
        # Claims are read, never written or listed.
        assert await api.get_resource_claim("default", "no-such-claim") is None

    asyncio.run(scenario())


def test_the_claim_webhook_is_accepted_and_the_control_plane_reads_only_what_it_needs(
    kube: Any, installed: list[dict[str, Any]]
) -> None:
    """The API server took the claim webhook as rendered (its CEL scope compiles), and the
    control plane's ServiceAccount may read what the webhook and why-pending read, no more."""
    from kubernetes import client

    (rendered,) = [d for d in installed if d["kind"] == "ValidatingWebhookConfiguration"]
    name = rendered["metadata"]["name"]
    stored_config = client.AdmissionregistrationV1Api(kube).read_validating_webhook_configuration(
        name
    )
    assert [h.name for h in stored_config.webhooks] == [
        "claims.tessera.io",
        "claim-pods.tessera.io",
    ]
    assert all(h.client_config.ca_bundle for h in stored_config.webhooks)
    resource = "resource.k8s.io"
    assert can(kube, "controlplane", "get", "pods")
    assert can(kube, "controlplane", "list", "resourceclaims", group=resource)
    assert can(kube, "controlplane", "get", "resourceclaimtemplates", group=resource)
    assert can(kube, "controlplane", "list", "resourceslices", group=resource, namespace="")
    assert not can(kube, "controlplane", "list", "pods")
    assert not can(kube, "controlplane", "create", "resourceclaims", group=resource)
    assert not can(kube, "controlplane", "update", "resourceslices", group=resource, namespace="")
    assert not can(kube, "controlplane", "list", "secrets")
