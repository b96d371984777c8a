"""The real-node suite's cluster (one per module, so it is gone before the next suite starts):
the harness with a real node (e2e/node.py), the images pushed to its registry, and the Helm
chart installed on it, so that the chart's node plugin DaemonSet runs from the pushed image on
the real kubelet.

What only the tests add, all through the chart's values (`chart_values` below):
a fake NVML library (tests/nodeplugin/harness/fake_nvml.c) and fake device nodes
(character devices like /dev/null, named nvidia<minor>) on the host, mounted into the plugin
with `nodeplugin.extraVolumes` and named by `nodeplugin.extraEnv`; the host paths of this run's
kubelet and containerd; the harness's control plane as `nodeplugin.controlplaneURL`. The plugin
itself runs as shipped.

The harness's own control plane plays the chart's (no Deployment controller runs here, so the
chart's control plane Deployments never get pods). So the chart's webhook TLS Secret is made
beforehand from the harness's certificate (the chart adopts it and keeps it, as it keeps any
existing one), the node token Secret holds a `createtoken` token of the node, and the chart's
MutatingWebhookConfiguration, which names a Service nothing serves here, is deleted after
install (the harness registers its own for the same webhook, as in every e2e run).
"""

from __future__ import annotations

import base64
import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e import objects
from e2e.cluster import Options
from e2e.harness import HarnessError, build_binaries, run_folder
from e2e.node import NODE_NAME, RealNodeCluster
from tests.deploy.chart import CHART, run_helm
from tests.nodeplugin.harness.gpu import FakeCard, build_fake_nvml

NAMESPACE = "tessera-system"
RELEASE = "tessera"
CARDS = [
    FakeCard(
        uuid=f"GPU-e2e0000{i}-aaaa-bbbb-cccc-00000000000{i}",
        name="NVIDIA A100-SXM4-40GB",
        memory_mib=40960,
        minor=i,
        numa=0,
        bus_id=f"00000000:{0x10 + i:02x}:00.0",
    )
    for i in range(4)
]
SLOTS = 10


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


def make_fake_gpu(root: Path) -> dict[str, str]:
    """The fake NVML, its card list and the fake device nodes under `root`; returns the
    plugin's environment for them."""
    lib = root / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    (lib / "libnvidia-ml.so.1").write_bytes((build_fake_nvml() / "libnvidia-ml.so.1").read_bytes())
    (root / "nvml-state" / "lost").mkdir(parents=True, exist_ok=True)
    (root / "nvml-state" / "events").touch()
    (root / "cards.txt").write_text(
        "".join(f"{c.uuid}|{c.name}|{c.memory_mib}|{c.minor}|{c.numa}|{c.bus_id}\n" for c in CARDS)
    )
    dev = root / "dev"
    dev.mkdir(exist_ok=True)
    null = os.stat("/dev/null").st_rdev
    for name in [f"nvidia{c.minor}" for c in CARDS] + ["nvidiactl", "nvidia-uvm"]:
        path = dev / name
        if not path.exists():
            os.mknod(path, 0o666 | stat.S_IFCHR, null)
        path.chmod(0o666)
    return {
        "LD_LIBRARY_PATH": str(lib),
        "FAKE_NVML_CARDS": str(root / "cards.txt"),
        "FAKE_NVML_STATE": str(root / "nvml-state"),
        "TESSERA_DEV_ROOT": str(dev),
    }


OVERSUB_FACTOR = 1.5
OVERSUB_RESERVE_MIB = 16384


def chart_values(
    cluster: RealNodeCluster, gpu_env: dict[str, str], gpu_root: Path
) -> dict[str, Any]:
    node = cluster.node_dir
    image = cluster.images["nodeplugin"]
    return {
        "image": {"registry": cluster.registry, "tag": image.tag},
        "nodeplugin": {
            "image": {"tag": image.tag},
            # No NVIDIA runtime here: NVML comes from the fake's folder (extraVolumes).
            "runtimeClassName": "",
            "hostNetwork": True,
            # The control plane's plain HTTP listener on the node's loopback (the harness's
            # HTTPS one is the webhook's, which the API server calls for every pod create).
            "controlplaneURL": cluster.controlplane_url,
            "slots": SLOTS,
            "metricsPort": 0,  # the host's network: no fixed port on a shared machine
            # Virtual device memory: the cards take opted-in slices up to 1.5 x their memory,
            # with 16 GiB of the host set aside for what spills (the machine must have it).
            "memoryOversubscription": "1.5",
            "spillReserveMiB": OVERSUB_RESERVE_MIB,
            "hostPaths": {
                "podResources": str(cluster.pod_resources_dir),
                "cdi": str(cluster.cdi_dir),
                "state": str(node / "plugin-state"),
                "regions": str(node / "regions"),
            },
            "shim": {"hostDir": str(node / "shim")},
            "extraEnv": {**gpu_env, "TESSERA_LOG_LEVEL": "debug", "TESSERA_HEARTBEAT_S": "5"},
            "extraVolumes": [{"name": "fake-gpu", "hostPath": {"path": str(gpu_root)}}],
            "extraVolumeMounts": [
                {"name": "fake-gpu", "mountPath": str(gpu_root), "readOnly": True}
            ],
        },
    }


def helm_owned(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": NAMESPACE,
        "labels": {"app.kubernetes.io/managed-by": "Helm"},
        "annotations": {
            "meta.helm.sh/release-name": RELEASE,
            "meta.helm.sh/release-namespace": NAMESPACE,
        },
    }


@pytest.fixture(scope="module")
def node_cluster() -> Iterator[RealNodeCluster]:
    # Four webhook workers: the API server calls the webhook for 20 pod creates at once.
    yield from running_harness(run_dir=run_folder("run-realnode"), webhook_workers=4)


def running_harness(**options: Any) -> Iterator[RealNodeCluster]:
    """The real-node harness with these `Options`, up for the caller's fixture and down after;
    a harness that cannot start fails the test with its reason."""
    try:
        binaries = build_binaries()
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    harness = RealNodeCluster(Options(binaries=binaries, **options))
    try:
        harness.up()
    except HarnessError as exc:
        pytest.fail(f"the e2e cluster with a real node did not come up: {exc}", pytrace=False)
    try:
        yield harness
    finally:
        harness.down()


@pytest.fixture(scope="module")
def kube(node_cluster: RealNodeCluster) -> Iterator[Any]:
    with contextlib.closing(node_cluster.api_client()) as api:
        yield api


@pytest.fixture(scope="module")
def core(kube: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(kube)


@pytest.fixture(scope="module")
def tessera(node_cluster: RealNodeCluster) -> objects.Tessera:
    return objects.Tessera(node_cluster.controlplane_url, node_cluster.admin_token)


def before_install(node_cluster: RealNodeCluster, core: Any) -> tuple[Path, dict[str, str], str]:
    """What the chart's install needs beforehand on the real node: the fake GPU, the release
    namespace, the webhook TLS Secret from the harness's certificate and the node token Secret.
    Returns the fake GPU's folder, the plugin's environment for it, and the node's token."""
    gpu_root = node_cluster.node_dir / "fake-gpu"
    gpu_env = make_fake_gpu(gpu_root)
    token = node_cluster.manage(
        "createtoken", NODE_NAME, "--role", "node", "--label", "e2e"
    ).strip()
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    pki = node_cluster.pki
    b64 = lambda p: base64.b64encode((pki / p).read_bytes()).decode()  # noqa: E731
    tls = {"tls.crt": b64("webhook.crt"), "tls.key": b64("webhook.key"), "ca.crt": b64("ca.crt")}
    core.create_namespaced_secret(
        NAMESPACE,
        {
            "metadata": helm_owned(f"{RELEASE}-webhook-tls"),
            "type": "kubernetes.io/tls",
            "data": tls,
        },
    )
    core.create_namespaced_secret(
        NAMESPACE,
        {"metadata": {"name": f"{RELEASE}-node-tokens"}, "stringData": {NODE_NAME: token}},
    )
    return gpu_root, gpu_env, token


@pytest.fixture(scope="module")
def installed(
    node_cluster: RealNodeCluster,
    core: Any,
    kube: Any,
    tessera: objects.Tessera,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """`helm install` of the chart with the real node's values; waits until the node plugin
    runs, registered `nvidia.com/gpu` with the kubelet and reported its cards."""
    from kubernetes import client

    gpu_root, gpu_env, token = before_install(node_cluster, core)
    values = node_cluster.node_dir / "chart-values.yaml"
    values.write_text(yaml.safe_dump(chart_values(node_cluster, gpu_env, gpu_root)))
    home = tmp_path_factory.mktemp("helm")
    run_helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--values", str(values),
             "--kubeconfig", str(node_cluster.kubeconfig), home=home)  # fmt: skip
    client.AdmissionregistrationV1Api(kube).delete_mutating_webhook_configuration(RELEASE)

    def registered() -> bool:
        return plugin_serving(core)

    what = "the chart's node plugin to register nvidia.com/gpu with the kubelet"
    objects.wait_for(registered, timeout=180, every=1, what=what)

    def reported() -> bool:
        cards = tessera_cards(tessera)
        return sorted(cards) == sorted(c.uuid for c in CARDS)

    objects.wait_for(reported, timeout=60, every=1, what="the plugin's inventory report")
    return {"values": values, "helm_home": home, "token": token}


def plugin_serving(core: Any) -> bool:
    """The kubelet has every slot of the plugin's cards allocatable (registered, healthy)."""
    node = core.read_node(NODE_NAME)
    return bool((node.status.allocatable or {}).get("nvidia.com/gpu") == str(len(CARDS) * SLOTS))


def node_cards(tessera: objects.Tessera) -> list[dict[str, Any]]:
    """The node's cards as the control plane's ledger has them, through its REST API."""
    answer = tessera.get("/api/v1/cards/", params={"node": NODE_NAME, "present": "true"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return list(body["results"] if isinstance(body, dict) else body)


def tessera_cards(tessera: objects.Tessera) -> list[str]:
    """The UUIDs of the node's cards in the control plane's ledger."""
    return [row["uuid"] for row in node_cards(tessera)]


@pytest.fixture
def namespace(core: Any, installed: dict[str, Any], request: pytest.FixtureRequest) -> str:
    # Each test starts on a node whose plugin is registered and healthy: a test before it may
    # have removed the plugin or restarted the kubelet, and a pod created before the devices are
    # allocatable again is refused at admission ("no healthy devices present").
    objects.wait_for(lambda: plugin_serving(core), timeout=120, every=0.5,
                     what="nvidia.com/gpu allocatable on the real node")  # fmt: skip
    name = objects.unique(request.node.name.replace("_", "-")[:30].strip("-").lower())
    return objects.create_namespace(core, name)
