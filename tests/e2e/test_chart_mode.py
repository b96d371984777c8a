"""Chart mode is really in effect: the running processes carry the chart's configuration.

With TESSERA_E2E_CHART_VALUES set (`make e2e-chart`: values-resources.yaml, which renames the
resources to tessera.io/* and the scheduler to tessera-slices so Tessera can sit beside NVIDIA's
device plugin), the harness configures the control plane, kube-scheduler and the webhook from
the rendered chart (e2e/chart.py). These tests read what is running (the processes' environment,
kube-scheduler's /configz, the registered MutatingWebhookConfiguration, the webhook's answers)
and compare it with a fresh rendering of the chart, then show the renamed resources at work: a
pod asking for nvidia.com/gpu is left to the default scheduler and NVIDIA's node, one asking for
the chart's names is Tessera's. They skip when chart mode is off.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest
import yaml

from controlplane.scheduling import ResourceNames
from e2e import objects
from e2e.chart import OVERRIDDEN, ChartConfig
from e2e.cluster import WEBHOOK_SKIP_LABEL, Cluster
from tests.deploy.chart import container
from tests.e2e.conftest import chart_values

ALLOCATION = "tessera.io/allocation"

# "rendered" first: it skips the module when chart mode is off.
pytestmark = pytest.mark.usefixtures("rendered", "gpu_nodes")


@pytest.fixture(scope="module")
def rendered(chart: ChartConfig | None) -> list[dict[str, Any]]:
    """The chart rendered again with the session's values files (read directly, not through
    e2e/chart.py, so these tests check the harness's reading of it too)."""
    if chart is None:
        pytest.skip("chart mode is off: TESSERA_E2E_CHART_VALUES is unset (make e2e-chart)")
    from tests.deploy.chart import render

    return render(*chart_values())


def _plain_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}


def _running_env(cluster: Cluster, component: str) -> dict[str, str]:
    return dict(psutil.Process(cluster.state["components"][component]["pid"]).environ())


def test_the_running_control_plane_has_the_charts_settings(
    cluster: Cluster, rendered: list[dict[str, Any]]
) -> None:
    app = _plain_env(container(rendered, "controlplane", "app"))
    sidecar = _plain_env(container(rendered, "scheduler", "extender"))
    assert app["TESSERA_ENV"] == "production"  # so the chart's own mode is what runs
    started = cluster.state["components"]
    components = [c for c in ("controlplane", "webhook", "extender", "celery") if c in started]
    assert {"controlplane", "webhook", "extender"} <= set(components)
    for component in components:
        running = _running_env(cluster, component)
        for name, value in {**app, **sidecar}.items():
            if name not in OVERRIDDEN:
                assert running.get(name) == value, (component, name)
        # What only the harness knows (e2e/chart.py OVERRIDDEN), its own values instead.
        assert running["TESSERA_KUBE_MODE"] == "kubeconfig"
        assert running["KUBECONFIG"] == str(cluster.kubeconfig)
        assert running["TESSERA_ALLOWED_HOSTS"] == "127.0.0.1,localhost"
        assert running["DATABASE_URL"] != app["DATABASE_URL"]
        assert len(running["TESSERA_SECRET_KEY"]) >= 50
        key_file = Path(running["TESSERA_ALLOCATION_KEY_FILE"])
        assert key_file.read_text().strip() == cluster.state["allocation_key"]
    resources = ResourceNames(
        gpu=app["TESSERA_RESOURCE_GPU"],
        gpumem=app["TESSERA_RESOURCE_GPUMEM"],
        gpumem_percentage=app["TESSERA_RESOURCE_GPUMEM_PERCENTAGE"],
        gpucores=app["TESSERA_RESOURCE_GPUCORES"],
        priority=app["TESSERA_RESOURCE_PRIORITY"],
    )
    assert cluster.resource_names == resources == objects.resources()
    assert cluster.scheduler_name == app["TESSERA_SCHEDULER_NAME"]


def test_kube_scheduler_runs_the_charts_profile_and_extender(
    cluster: Cluster, rendered: list[dict[str, Any]]
) -> None:
    # The configuration kube-scheduler is running, as it reports it (/configz, admin identity).
    url = f"https://127.0.0.1:{cluster.ports['kube-scheduler']}/configz"
    ctx = cluster.admin_ssl_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # its self-signed serving certificate
    with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
        running = json.loads(resp.read())["componentconfig"]
    [configmap] = [
        d for d in rendered if d["kind"] == "ConfigMap" and "scheduler-config.yaml" in d["data"]
    ]
    chart = yaml.safe_load(configmap["data"]["scheduler-config.yaml"])

    names = [p["schedulerName"] for p in running["profiles"]]
    assert names == ["default-scheduler", *(p["schedulerName"] for p in chart["profiles"])]
    [extender] = running["extenders"]
    [wanted] = chart["extenders"]
    assert extender["urlPrefix"] == cluster.extender_url + urlsplit(wanted["urlPrefix"]).path
    for key in ("filterVerb", "prioritizeVerb", "preemptVerb", "bindVerb", "weight",
                "nodeCacheCapable", "ignorable", "enableHTTPS"):  # fmt: skip
        # /configz leaves out fields at their zero value (false)
        assert extender.get(key, False) == wanted[key], (key, extender)
    assert extender["httpTimeout"] == wanted["httpTimeout"]
    assert extender["managedResources"] == wanted["managedResources"]
    assert {m["name"] for m in extender["managedResources"]} == set(cluster.resource_names.all())


def test_the_webhook_is_registered_as_the_chart_renders_it(
    cluster: Cluster, kube: Any, rendered: list[dict[str, Any]]
) -> None:
    [config] = [d for d in rendered if d["kind"] == "MutatingWebhookConfiguration"]
    [wanted] = config["webhooks"]
    from kubernetes import client

    raw = client.AdmissionregistrationV1Api(kube).read_mutating_webhook_configuration(
        "tessera-e2e", _preload_content=False
    )
    [hook] = json.loads(raw.data)["webhooks"]
    for key in ("name", "rules", "failurePolicy", "matchConditions", "objectSelector",
                "timeoutSeconds", "sideEffects", "reinvocationPolicy", "matchPolicy"):  # fmt: skip
        assert hook[key] == wanted[key], key
    skip = {"key": WEBHOOK_SKIP_LABEL, "operator": "NotIn", "values": ["skip"]}
    assert hook["namespaceSelector"]["matchExpressions"] == [
        *wanted["namespaceSelector"]["matchExpressions"],
        skip,
    ]
    assert hook["clientConfig"]["url"] == cluster.webhook_url + "/webhook/mutate"
    expression = hook["matchConditions"][0]["expression"]
    assert all(name in expression for name in cluster.resource_names.all())


def _review(cluster: Cluster, pod: dict[str, Any]) -> dict[str, Any]:
    """The webhook listener's answer to an AdmissionReview, sent straight to it (past the API
    server's matchConditions): what the running process itself makes of the pod."""
    pod = {**pod, "metadata": {**pod["metadata"], "namespace": "default"}}
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE",
            "namespace": "default",
            "object": pod,
        },
    }
    request = urllib.request.Request(
        cluster.webhook_url + "/webhook/mutate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    ca = ssl.create_default_context(cafile=str(cluster.pki / "ca.crt"))
    with urllib.request.urlopen(request, timeout=10, context=ca) as resp:
        return dict(json.loads(resp.read())["response"])


def _renamed(cluster: Cluster) -> ResourceNames:
    if cluster.resource_names.gpu == ResourceNames().gpu:
        pytest.skip("the chart keeps nvidia.com/gpu; use values that rename it (values-resources)")
    return ResourceNames()  # HAMi's / NVIDIA's names, which Tessera must now leave alone


def test_the_webhook_process_manages_only_the_charts_names(
    cluster: Cluster, rendered: list[dict[str, Any]]
) -> None:
    default = _renamed(cluster)
    theirs = _review(cluster, objects.gpu_pod("theirs", gpumem=1000, names=default))
    assert theirs["allowed"] is True and "patch" not in theirs, theirs

    ours = _review(cluster, objects.gpu_pod("ours", gpumem=1000))
    assert ours["allowed"] is True, ours
    patch = json.loads(base64.b64decode(ours["patch"]))
    assert {"op": "add", "path": "/spec/schedulerName", "value": cluster.scheduler_name} in patch


def test_a_pod_asking_for_nvidia_gpu_is_left_to_the_default_scheduler(
    cluster: Cluster, core: Any, namespace: str, tessera: objects.Tessera
) -> None:
    default = _renamed(cluster)
    # A node of NVIDIA's device plugin beside Tessera's: whole cards under nvidia.com/gpu.
    pool = objects.unique("nvidia")
    node = f"{pool}-node"
    core.create_node(objects.gpu_node(node, cards=2, slots=1, pool=pool, resource=default.gpu))
    core.create_namespaced_pod(namespace, objects.gpu_pod("whole-card", pool=pool, names=default))
    core.create_namespaced_pod(namespace, objects.gpu_pod("slice", gpumem=1000))

    theirs = objects.wait_running(core, namespace, "whole-card")
    assert theirs.spec.scheduler_name == "default-scheduler"  # the webhook let it by
    assert theirs.spec.node_name == node
    assert ALLOCATION not in (theirs.metadata.annotations or {})
    assert tessera.allocation(namespace, "whole-card").status_code == 404
    assert tessera.why(namespace, "whole-card").status_code == 404  # never asked to place it

    ours = objects.wait_running(core, namespace, "slice")
    assert ours.spec.scheduler_name == cluster.scheduler_name
    assert ours.spec.node_name != node
    record = json.loads(ours.metadata.annotations[ALLOCATION])
    assert record["containers"][0]["devices"][0]["memory_mib"] == 1000
    assert tessera.allocation(namespace, "slice").json() == record
