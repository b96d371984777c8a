"""GPU pods on the real node: webhook → kube-scheduler with Tessera's extender → bind → the real
kubelet → the chart's node plugin (Allocate → PreStartContainer → CDI spec) → containerd.

Each pod runs images/gpu-test's probe, which prints what its container sees: the environment
of the CDI spec, the /dev/nvidia* nodes, /etc/ld.so.preload, whether the shim is mapped, and
the result of an allocation inside its slice and one past it, through the fake libcuda.so.1.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import time
from typing import Any

import pytest

from e2e import objects
from e2e.node import NODE_LABEL, NODE_NAME, RealNodeCluster
from nodeplugin.app import STOPPING
from tests.realnode.conftest import (
    CARDS,
    NAMESPACE,
    OVERSUB_FACTOR,
    RELEASE,
    SLOTS,
    node_cards,
    plugin_serving,
)

CUDA_ERROR_OUT_OF_MEMORY = 2
MINOR = {c.uuid: c.minor for c in CARDS}
CONTROL_DEVICES = ["nvidia-uvm", "nvidiactl"]


def probe_pod(cluster: RealNodeCluster, name: str, *, gpus: int, gpumem: int) -> dict[str, Any]:
    pod = objects.gpu_pod(name, gpus=gpus, gpumem=gpumem)
    spec = pod["spec"]
    container = spec["containers"][0]
    container["image"] = cluster.image_ref("gpu-test")
    container["args"] = [f"--inside={gpumem // 2}", f"--beyond={gpumem + 1}",
                         f"--card-mib={CARDS[0].memory_mib}", "--sleep"]  # fmt: skip
    spec["nodeSelector"] = {NODE_LABEL: "true"}
    spec["hostNetwork"] = True  # no CNI on the node
    spec["terminationGracePeriodSeconds"] = 1
    return pod


def create(core: Any, namespace: str, pod: dict[str, Any]) -> None:
    """Create the pod; again when the API server's call to the webhook timed out (20 creates
    at once on a loaded 2-core machine can take the webhook past its 5 s), never otherwise."""
    from kubernetes.client.rest import ApiException

    for attempt in range(3):
        try:
            core.create_namespaced_pod(namespace, pod)
            return
        except ApiException as exc:
            if (
                exc.status != 500
                or "context deadline exceeded" not in str(exc.body)
                or attempt == 2
            ):
                raise


def reports(
    cluster: RealNodeCluster, namespace: str, name: str, container: str = "app"
) -> list[dict[str, Any]]:
    """The probe's reports, one per start of the container, oldest first."""
    found = []
    for line in cluster.pod_log(namespace, name, container):
        if line.startswith("{"):
            found.append(json.loads(line))
    return found


def allocated_cards(core: Any, namespace: str, name: str, container_name: str = "app") -> list[str]:
    """The card UUIDs the control plane's record gives the pod's container, in its order."""
    pod = core.read_namespaced_pod(name, namespace)
    record = json.loads(pod.metadata.annotations["tessera.io/allocation"])
    (container,) = [c for c in record["containers"] if c["name"] == container_name]
    return [d["uuid"] for d in container["devices"]]


def running(core: Any, namespace: str, name: str) -> bool:
    pod = core.read_namespaced_pod(name, namespace)
    if pod.status.phase in ("Failed", "Succeeded"):
        raise AssertionError(f"{namespace}/{name} ended: {pod.status.phase} {pod.status.reason} "
                             f"{pod.status.message}")  # fmt: skip
    return bool(pod.status.phase == "Running")


def check_sees_exactly_its_cards(
    report: dict[str, Any], cards: list[str], gpumem: int, where: str
) -> None:
    env = report["env"]
    assert env.get("CUDA_VISIBLE_DEVICES") == ",".join(cards), where
    assert env.get("NVIDIA_VISIBLE_DEVICES") == ",".join(cards), where
    for i in range(len(cards)):
        assert env.get(f"TESSERA_DEVICE_MEMORY_LIMIT_{i}") == str(gpumem), where
    assert f"TESSERA_DEVICE_MEMORY_LIMIT_{len(cards)}" not in env, where
    expected = sorted([f"nvidia{MINOR[u]}" for u in cards] + CONTROL_DEVICES)
    assert report["devices"] == expected, where
    assert report["preload"] and "libtessera.so" in report["preload"], where
    assert report["shim_mapped"] is True, where
    assert report["cuInit"] == 0 and report["device_count"] == len(cards), where
    assert report["total_mib"] == gpumem, where  # the shim reports the slice as the total
    assert report["inside"] == 0, where
    assert report["beyond"] == CUDA_ERROR_OUT_OF_MEMORY, where


def wait_report(
    cluster: RealNodeCluster, namespace: str, name: str, count: int = 1, container: str = "app"
) -> list[Any]:
    return list(
        objects.wait_for(
            lambda: (r := reports(cluster, namespace, name, container)) and len(r) >= count and r,
            timeout=60,
            what=f"{count} probe report(s) from {namespace}/{name}:{container}",
        )
    )


def start_pod(
    cluster: RealNodeCluster, core: Any, namespace: str, name: str, *, gpus: int, gpumem: int
) -> tuple[list[str], dict[str, Any]]:
    core.create_namespaced_pod(namespace, probe_pod(cluster, name, gpus=gpus, gpumem=gpumem))
    objects.wait_for(lambda: running(core, namespace, name), timeout=120, every=0.5,
                     what=f"{namespace}/{name} Running on the real node")  # fmt: skip
    report = wait_report(cluster, namespace, name)[-1]
    return allocated_cards(core, namespace, name), report


def plugin_pods(core: Any) -> list[Any]:
    """The node plugin's pods, terminating ones included."""
    return list(
        core.list_namespaced_pod(
            NAMESPACE, label_selector="app.kubernetes.io/component=nodeplugin"
        ).items
    )


def plugin_pod(core: Any) -> Any:
    """The node plugin's one live pod, or None."""
    live = [p for p in plugin_pods(core) if p.metadata.deletion_timestamp is None]
    return live[0] if len(live) == 1 else None


def prestart_calls(cluster: RealNodeCluster, core: Any, allocation: str) -> int:
    """How many PreStartContainer calls the plugin pod logged that wrote CDI name `allocation`."""
    pod = plugin_pod(core)
    lines = cluster.pod_log(NAMESPACE, pod.metadata.name, "nodeplugin")
    return sum(1 for line in lines if "PreStartContainer" in line and allocation in line)


def test_chart_node_plugin_runs_from_the_pushed_image(
    node_cluster: RealNodeCluster, core: Any, installed: dict[str, Any]
) -> None:
    pod = plugin_pod(core)
    assert pod is not None and pod.spec.node_name == NODE_NAME
    (container,) = pod.spec.containers
    assert container.image == node_cluster.image_ref("nodeplugin")
    assert container.image.startswith("127.0.0.1:")  # the harness's registry
    status = pod.status.container_statuses[0]
    assert status.ready or status.state.running, status
    images = node_cluster.crictl("images", "-o", "json").stdout
    assert node_cluster.image_ref("nodeplugin").rsplit(":", 1)[0] in images


def test_twenty_pods_at_once_each_get_exactly_their_cards(
    node_cluster: RealNodeCluster, core: Any, namespace: str
) -> None:
    shapes = [(1, 1000 + 100 * i) for i in range(15)] + [(2, 1500 + 100 * i) for i in range(5)]
    pods = [(f"burst-{i}", gpus, gpumem) for i, (gpus, gpumem) in enumerate(shapes)]
    random.Random(7).shuffle(pods)
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        pod_specs = [probe_pod(node_cluster, n, gpus=g, gpumem=m) for n, g, m in pods]
        list(pool.map(lambda spec: create(core, namespace, spec), pod_specs))

    def all_running() -> bool:
        return all(running(core, namespace, name) for name, _, _ in pods)

    objects.wait_for(all_running, timeout=300, every=1, what="20 GPU pods Running")
    used: dict[str, int] = {}
    for name, gpus, gpumem in pods:
        cards = allocated_cards(core, namespace, name)
        assert len(cards) == gpus == len(set(cards)), name
        for uuid in cards:
            used[uuid] = used.get(uuid, 0) + 1
        (report,) = wait_report(node_cluster, namespace, name)
        check_sees_exactly_its_cards(report, cards, gpumem, f"{namespace}/{name}")
        status = core.read_namespaced_pod(name, namespace).status.container_statuses[0]
        assert status.restart_count == 0, name  # nothing refused and started again
    assert all(n <= SLOTS for n in used.values())
    assert len(used) > 1  # the extender spread them over the cards, and each pod saw its own


def test_container_restart_calls_prestart_again_with_the_same_cards(
    node_cluster: RealNodeCluster, core: Any, namespace: str
) -> None:
    cards, first = start_pod(node_cluster, core, namespace, "restarted", gpus=2, gpumem=2048)
    check_sees_exactly_its_cards(first, cards, 2048, "first start")
    (status,) = core.read_namespaced_pod("restarted", namespace).status.container_statuses
    container_id = status.container_id.split("://", 1)[1]
    allocation = first["env"]["TESSERA_ALLOCATION"]  # the CDI name Allocate handed out
    assert prestart_calls(node_cluster, core, allocation) == 1
    stopped = node_cluster.crictl("stop", container_id)
    assert stopped.returncode == 0, stopped.stderr
    second = wait_report(node_cluster, namespace, "restarted", count=2)[1]
    check_sees_exactly_its_cards(second, cards, 2048, "after the restart")
    # The kubelet asked the plugin again before creating the new container, for the same name.
    assert second["env"]["TESSERA_ALLOCATION"] == allocation
    assert prestart_calls(node_cluster, core, allocation) == 2

    def restarted() -> bool:
        st = core.read_namespaced_pod("restarted", namespace).status.container_statuses[0]
        return bool(st.restart_count >= 1 and st.state.running)

    objects.wait_for(restarted, timeout=60, what="the container running again")


def test_kubelet_restart_plugin_registers_again_and_slices_stay(
    node_cluster: RealNodeCluster, core: Any, namespace: str
) -> None:
    cards, report = start_pod(node_cluster, core, namespace, "before", gpus=1, gpumem=3000)
    check_sees_exactly_its_cards(report, cards, 3000, "before the restart")
    (status,) = core.read_namespaced_pod("before", namespace).status.container_statuses
    plugin_before = plugin_pod(core)
    node_cluster.restart_kubelet()

    def registered_again() -> bool:
        return plugin_serving(core) and "tessera-gpu.sock" in _device_plugin_sockets()

    objects.wait_for(registered_again, timeout=120, every=0.5,
                     what="the plugin registered again with the restarted kubelet")  # fmt: skip
    # The running container was left alone: same container, no restart, same slice.
    after = core.read_namespaced_pod("before", namespace).status.container_statuses[0]
    assert after.container_id == status.container_id and after.restart_count == 0
    assert len(reports(node_cluster, namespace, "before")) == 1
    # The plugin pod is the same one: it noticed the kubelet's new socket and registered again.
    assert plugin_pod(core).metadata.uid == plugin_before.metadata.uid
    cards_after, report_after = start_pod(
        node_cluster, core, namespace, "after", gpus=1, gpumem=2500
    )
    check_sees_exactly_its_cards(report_after, cards_after, 2500, "after the restart")


def _device_plugin_sockets() -> list[str]:
    from e2e.node import DEVICE_PLUGIN_DIR

    return sorted(p.name for p in DEVICE_PLUGIN_DIR.glob("*.sock"))


# The replacement's race (which of the two plugins the kubelet hears from last) is won or lost by
# chance; TESSERA_E2E_REPEAT=N runs it N times in one session, each on the same node.
@pytest.mark.parametrize("attempt", range(int(os.environ.get("TESSERA_E2E_REPEAT", "1"))))
def test_plugin_pod_deleted_daemonset_recreates_it_and_pods_still_start(
    node_cluster: RealNodeCluster, core: Any, namespace: str, attempt: int
) -> None:
    """The DaemonSet replaces the node plugin's pod (deleted; its successor starts while it
    terminates). A GPU pod created while that happens must neither fail nor start without its
    card: it waits until the node's plugin serves again, then starts with its card."""
    old = plugin_pod(core)
    core.delete_namespaced_pod(old.metadata.name, NAMESPACE)
    # At once: the old plugin is going, the new one not yet registered.
    create(core, namespace, probe_pod(node_cluster, "during", gpus=1, gpumem=1500))

    def replaced() -> Any:
        pod = plugin_pod(core)
        if pod is None or pod.metadata.uid == old.metadata.uid or pod.status.phase != "Running":
            return None
        return pod

    new = objects.wait_for(replaced, timeout=120, every=0.5,
                           what="the DaemonSet's new node plugin pod Running")  # fmt: skip
    assert new.spec.node_name == NODE_NAME
    objects.wait_for(lambda: len(plugin_pods(core)) == 1, timeout=60, what="the old pod gone")
    # `running` fails the test the moment the pod is Failed (the kubelet refused it at admission).
    objects.wait_for(lambda: running(core, namespace, "during"), timeout=120, every=0.5,
                     what="the pod created during the replacement Running")  # fmt: skip
    report = wait_report(node_cluster, namespace, "during")[0]
    check_sees_exactly_its_cards(
        report, allocated_cards(core, namespace, "during"), 1500, "created during the replacement"
    )
    cards, report = start_pod(node_cluster, core, namespace, "after-plugin", gpus=1, gpumem=1800)
    check_sees_exactly_its_cards(report, cards, 1800, "after the plugin pod was replaced")


def test_pod_created_while_no_plugin_serves_waits_and_then_starts_with_its_devices(
    node_cluster: RealNodeCluster, core: Any, kube: Any, tessera: objects.Tessera, namespace: str
) -> None:
    """With the plugin gone (its DaemonSet moved off the node) and the kubelet restarted, so no
    plugin is registered, a GPU pod is not bound to the node, where the kubelet would refuse
    it for good: the plugin told the control plane, as it stopped, that its cards take no new
    pods. The pod waits; once the plugin is back it is bound and starts with its card."""
    from kubernetes import client

    apps = client.AppsV1Api(kube)
    ds_name = f"{RELEASE}-nodeplugin"

    def selector(value: str | None) -> dict[str, Any]:
        return {"spec": {"template": {"spec": {"nodeSelector": {"tessera.io/e2e-nowhere": value}}}}}

    apps.patch_namespaced_daemon_set(ds_name, NAMESPACE, selector("true"))
    try:
        # Gone for good (not only terminating: its process would register again).
        objects.wait_for(lambda: not plugin_pods(core), timeout=90,
                         what="the node plugin pod gone")  # fmt: skip
        node_cluster.restart_kubelet()
        assert "tessera-gpu.sock" not in _device_plugin_sockets()
        cards = node_cards(tessera)
        assert cards and all(not c["healthy"] for c in cards), cards
        assert {c["health_reason"] for c in cards} == {STOPPING}, cards
        create(core, namespace, probe_pod(node_cluster, "early", gpus=1, gpumem=1200))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            pod = core.read_namespaced_pod("early", namespace)
            assert pod.spec.node_name is None, "bound to a node whose plugin does not serve"
            time.sleep(0.5)
        assert reports(node_cluster, namespace, "early") == []
        (scheduled,) = [c for c in pod.status.conditions or [] if c.type == "PodScheduled"]
        assert scheduled.status == "False" and scheduled.reason == "Unschedulable", scheduled
    finally:
        apps.patch_namespaced_daemon_set(ds_name, NAMESPACE, selector(None))
    objects.wait_for(lambda: (p := plugin_pod(core)) is not None and p.status.phase == "Running",
                     timeout=120, what="the node plugin back")  # fmt: skip
    objects.wait_for(lambda: running(core, namespace, "early"), timeout=120, every=0.5,
                     what="the waiting pod bound and started once the plugin serves")  # fmt: skip
    report = wait_report(node_cluster, namespace, "early")[0]
    check_sees_exactly_its_cards(
        report, allocated_cards(core, namespace, "early"), 1200, "started after registration"
    )
    assert all(c["healthy"] for c in node_cards(tessera))


pytestmark = pytest.mark.usefixtures("installed")


def test_a_gpu_sidecar_and_the_app_container_each_get_their_own_slice(
    node_cluster: RealNodeCluster, core: Any, namespace: str
) -> None:
    """A restartable init container (a sidecar) keeps its slice beside the app container: the
    real kubelet lists it and gives it device IDs of its own, and the plugin must pair each
    container with its own record entry, never the sidecar's twice."""
    pod = probe_pod(node_cluster, "with-sidecar", gpus=1, gpumem=2000)
    side = json.loads(json.dumps(pod["spec"]["containers"][0]))
    side["name"], side["restartPolicy"] = "sidecar", "Always"
    side["resources"]["limits"]["nvidia.com/gpumem"] = "1000"
    side["args"] = ["--inside=500", "--beyond=1001", f"--card-mib={CARDS[0].memory_mib}", "--sleep"]
    pod["spec"]["initContainers"] = [side]
    core.create_namespaced_pod(namespace, pod)
    objects.wait_for(lambda: running(core, namespace, "with-sidecar"), timeout=120, every=0.5,
                     what=f"{namespace}/with-sidecar Running on the real node")  # fmt: skip
    record = json.loads(
        core.read_namespaced_pod("with-sidecar", namespace).metadata.annotations[
            "tessera.io/allocation"
        ]
    )
    assert [c.get("sidecar", False) for c in record["containers"] if c["init"]] == [True]
    for container, gpumem in (("sidecar", 1000), ("app", 2000)):
        cards = allocated_cards(core, namespace, "with-sidecar", container)
        report = wait_report(node_cluster, namespace, "with-sidecar", container=container)[-1]
        check_sees_exactly_its_cards(report, cards, gpumem, f"{namespace}/with-sidecar:{container}")


def free_the_cards(core: Any, tessera: objects.Tessera, keep: str, resident_mib: int) -> None:
    """Delete the pods of the other test namespaces and wait until a card of the node has
    ``resident_mib`` of resident memory free in the ledger (the reconciler releases the slices
    of pods that are gone)."""
    for ns in core.list_namespace().items:
        name = ns.metadata.name
        if name.startswith("test-") and name != keep:
            core.delete_collection_namespaced_pod(name, grace_period_seconds=0)

    def room() -> bool:
        return any(
            card["memory_mib"] - card["memory_resident_allocated_mib"] >= resident_mib
            for card in node_cards(tessera)
        )

    objects.wait_for(room, timeout=180, every=1,
                     what=f"a card with {resident_mib} MiB of resident memory free")  # fmt: skip


def test_an_opted_in_pod_sees_a_slice_past_the_card_and_spills_past_its_resident_part(
    node_cluster: RealNodeCluster, core: Any, namespace: str, tessera: objects.Tessera
) -> None:
    """Virtual device memory end to end: a pod annotated tessera.io/memory-oversubscription on
    cards whose factor is 1.5 (the chart's node value) gets a slice larger than the card; the
    record gives it a resident part, the plugin passes both to the shim, and in the container
    the slice is the total, an allocation within the resident part is plain, one past it is
    served managed, and one past the slice is refused."""
    gpumem = CARDS[0].memory_mib + 4096  # past the card: only an oversubscribed slice fits
    resident = -(-gpumem * 10 // round(OVERSUB_FACTOR * 10))
    # Its resident part is two thirds of a card: the pods earlier tests left running (twenty at
    # once, sidecars, restarts) must give their room back first.
    free_the_cards(core, tessera, namespace, resident)
    pod = probe_pod(node_cluster, "oversub", gpus=1, gpumem=gpumem)
    pod["metadata"].setdefault("annotations", {})["tessera.io/memory-oversubscription"] = "true"
    inside, spill = resident // 2, gpumem // 2  # together past the resident part, within the slice
    pod["spec"]["containers"][0]["args"] = [
        f"--inside={inside}", f"--beyond={gpumem + 1}", f"--spill={spill}",
        f"--card-mib={CARDS[0].memory_mib}", "--sleep",
    ]  # fmt: skip
    core.create_namespaced_pod(namespace, pod)
    objects.wait_for(lambda: running(core, namespace, "oversub"), timeout=120, every=0.5,
                     what=f"{namespace}/oversub Running on the real node")  # fmt: skip
    record = json.loads(
        core.read_namespaced_pod("oversub", namespace).metadata.annotations["tessera.io/allocation"]
    )
    (device,) = record["containers"][0]["devices"]
    assert (device["memory_mib"], device["resident_mib"]) == (gpumem, resident)
    report = wait_report(node_cluster, namespace, "oversub")[-1]
    where = f"{namespace}/oversub"
    env = report["env"]
    assert env.get("TESSERA_DEVICE_MEMORY_LIMIT_0") == str(gpumem), where
    assert env.get("TESSERA_DEVICE_MEMORY_RESIDENT_0") == str(resident), where
    assert report["shim_mapped"] is True and report["cuInit"] == 0, where
    assert report["total_mib"] == gpumem, where  # the slice, though it passes the card
    assert (report["inside"], report["inside_via"]) == (0, "alloc"), where
    assert (report["spill"], report["spill_via"]) == (0, "managed"), where
    assert report["beyond"] == CUDA_ERROR_OUT_OF_MEMORY, where
