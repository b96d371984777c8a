"""`kubectl tessera` run by a real kubectl against the harness cluster and control plane.

kubectl (the pinned version, built by e2e/build.sh) finds `kubectl-tessera` on PATH, as it would
on an operator's machine, and passes it the arguments (docs/kubectl-plugin.md). The plugin talks
to the control plane under test with the tokens its `createtoken` command makes.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e import objects
from e2e.cluster import Cluster
from e2e.harness import HarnessError, build_binaries
from e2e.ports import free_port
from tests.e2e.conftest import CARD_MEMORY_MIB, CARDS_PER_NODE, NODES

pytestmark = pytest.mark.usefixtures("gpu_nodes")

PIN = "nvidia.com/use-gpuuuid"


@pytest.fixture(scope="module")
def kubectl() -> Path:
    try:
        return build_binaries(("kubectl",))["kubectl"]
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def plugin_env(kubectl: Path, cluster: Cluster) -> dict[str, str]:
    """kubectl and the installed `kubectl-tessera` (the venv's scripts) first on PATH; the
    harness's control plane and admin token in the plugin's environment variables."""
    path = os.pathsep.join([str(kubectl.parent), str(Path(sys.executable).parent), os.defpath])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env.update(
        PATH=path,
        KUBECONFIG=str(cluster.kubeconfig),
        TESSERA_SERVER=cluster.controlplane_url,
        TESSERA_TOKEN=cluster.admin_token,
    )
    return env


class Run:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.code, self.out, self.err = proc.returncode, proc.stdout, proc.stderr

    def ok(self) -> str:
        assert self.code == 0, f"exit {self.code}: {self.err}"
        return self.out

    def json(self) -> Any:
        return json.loads(self.ok())


@pytest.fixture
def tessera_cli(plugin_env: dict[str, str]) -> Any:
    def run(*args: str, env: dict[str, str] | None = None, plugin: bool = True) -> Run:
        proc = subprocess.run(
            ["kubectl", *(["tessera"] if plugin else []), *args],
            env={**plugin_env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return Run(proc)

    return run


def _card_row(table: str, uuid: str) -> list[str]:
    for line in table.splitlines():
        if line.split()[:1] == [uuid]:
            return line.split()
    raise AssertionError(f"no row for card {uuid} in:\n{table}")


def _wait_phase(core: Any, namespace: str, name: str, phase: str) -> Any:
    def reached() -> Any:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase == phase else None

    return objects.wait_for(reached, timeout=60, what=f"pod {namespace}/{name} to be {phase}")


def test_kubectl_finds_the_plugin(tessera_cli: Any) -> None:
    listed = tessera_cli("plugin", "list", plugin=False)
    assert "/kubectl-tessera\n" in listed.out, listed.out + listed.err
    assert "inspect" in tessera_cli("--help").ok()


def test_inspect_shows_a_bound_pod_under_its_card(
    tessera_cli: Any,
    core: Any,
    namespace: str,
    tessera: objects.Tessera,
    node_tokens: dict[str, str],
) -> None:
    node, card = NODES[2], f"GPU-{NODES[2]}-5"
    pod = objects.gpu_pod("trainer", gpumem=7000, gpucores=20, annotations={PIN: card})
    core.create_namespaced_pod(namespace, pod)
    _wait_phase(core, namespace, "trainer", "Running")

    table = tessera_cli("inspect", node).ok()
    lines = table.splitlines()
    header = lines[0].split()
    assert header == [
        "NODE", "CARD", "MODEL", "MODE", "MEMORY(MiB)", "COMPUTE(%)", "SLOTS", "STATE"
    ]  # fmt: skip
    assert lines[1].split()[0] == node and lines[1].split()[1] == str(CARDS_PER_NODE)
    row = next(i for i, line in enumerate(lines) if line.split()[:1] == [card])
    # The card's own row, then its pods: this pod's slice, right under it.
    pods_below = []
    for line in lines[row + 1 :]:
        if not line.startswith(" ") or line.split()[0].startswith("GPU-"):
            break
        pods_below.append(line.split())
    assert [namespace + "/trainer/app", "7000", "20", "bound"] in pods_below, table
    memory, compute = _card_row(table, card)[-4:-2]
    assert int(memory.split("/")[0]) >= 7000 and int(compute.split("/")[0]) >= 20

    [answer] = tessera_cli("inspect", node, "-o", "json").json()
    [held] = [c for c in answer["cards"] if c["uuid"] == card]
    mine = [s for s in held["slices"] if s["namespace"] == namespace]
    assert [(s["pod"], s["memory_mib"], s["compute_percent"]) for s in mine] == [
        ("trainer", 7000, 20)
    ]
    # The whole cluster's view holds it too, and top shows the container against its slice.
    everyone = tessera_cli("inspect", "-o", "yaml").ok()
    assert "pod: trainer\n" in everyone and f"namespace: {namespace}\n" in everyone
    top = tessera_cli("top", "-n", namespace).ok().splitlines()
    assert top[1].split() == [namespace, "trainer", "app", node, card, "-/7000", "-/20"]
    # Once the node's plugin reports what the container uses, top shows it against the slice.
    report = objects.inventory(node, cards=CARDS_PER_NODE, memory_mib=CARD_MEMORY_MIB)
    report["usage"] = [
        {"namespace": namespace, "pod": "trainer", "container": "app", "card": card,
         "memory_used_mib": 5123, "compute_used_percent": 12}
    ]  # fmt: skip
    answer = tessera.with_token(node_tokens[node]).report_inventory(node, report)
    assert answer.status_code == 200, answer.text
    top = tessera_cli("top", "-n", namespace).ok().splitlines()
    assert top[1].split() == [namespace, "trainer", "app", node, card, "5123/7000", "12/20"]


def test_cordon_and_uncordon_a_card_and_a_node_show_in_inspect(tessera_cli: Any) -> None:
    node, card = NODES[7], f"GPU-{NODES[7]}-6"
    try:
        said = tessera_cli("cordon", card, "--reason", "kubectl plugin e2e").ok()
        assert said.strip() == f"card/{card} cordoned"
        assert _card_row(tessera_cli("inspect", node).ok(), card)[-1] == "cordoned"
        [answer] = tessera_cli("inspect", node, "-o", "json").json()
        assert [c["cordoned"] for c in answer["cards"] if c["uuid"] == card] == [True]

        assert tessera_cli("cordon", f"node/{node}").ok().strip() == f"node/{node} cordoned"
        node_row = tessera_cli("inspect", node).ok().splitlines()[1].split()
        assert node_row[0] == node and node_row[-1] == "ready,cordoned"
    finally:
        tessera_cli("uncordon", f"card/{card}").ok()
        tessera_cli("uncordon", f"node/{node}").ok()
    table = tessera_cli("inspect", node).ok()
    assert _card_row(table, card)[-1] == "ok"
    assert table.splitlines()[1].split()[-1] == "ready"


def test_why_tells_why_a_pod_is_pending(tessera_cli: Any, core: Any, namespace: str) -> None:
    card = f"GPU-{NODES[6]}-4"
    tessera_cli("cordon", card).ok()
    try:
        pod = objects.gpu_pod("waiter", gpumem=1000, annotations={PIN: card})
        core.create_namespaced_pod(namespace, pod)

        def decided() -> Run | None:
            run = tessera_cli("why", "waiter", "-n", namespace)
            return run if run.code == 0 and "unschedulable" in run.out else None

        answer = objects.wait_for(decided, timeout=60, what="a why-pending answer", every=1)
        lines = answer.out.splitlines()
        assert lines[0].split() == ["Pod:", f"{namespace}/waiter"]
        assert lines[1].split() == ["Outcome:", "unschedulable"], answer.out
        assert "cordon" in answer.out.lower(), answer.out
        data = tessera_cli("why", "waiter", "-n", namespace, "-o", "json").json()
        assert data["name"] == "waiter" and data["binding"] is None
        assert core.read_namespaced_pod("waiter", namespace).status.phase == "Pending"
    finally:
        core.delete_namespaced_pod("waiter", namespace, grace_period_seconds=0)
        tessera_cli("uncordon", card).ok()


def test_quota_set_then_get(tessera_cli: Any, namespace: str) -> None:
    assert tessera_cli("quota", "get", namespace).code == 1  # none yet: a 404
    made = tessera_cli("quota", "set", namespace, "--gpumem", "20000", "--gpus", "2").ok()
    assert made.splitlines()[1].split()[:4] == [namespace, "0/20000", "0/unlimited", "0/2"]
    # Setting one limit keeps the others.
    tessera_cli("quota", "set", namespace, "--gpucores", "150").ok()
    [row] = [
        line.split()
        for line in tessera_cli("quota", "get").ok().splitlines()
        if line.split()[:1] == [namespace]
    ]
    assert row[:4] == [namespace, "0/20000", "0/150", "0/2"]
    data = tessera_cli("quota", "get", namespace, "-o", "json").json()
    assert [data[0][k] for k in ("gpumem_mib", "gpucores", "gpus")] == [20000, 150, 2]
    tessera_cli("quota", "set", namespace, "--gpus", "unlimited").ok()
    assert tessera_cli("quota", "get", namespace, "-o", "json").json()[0]["gpus"] is None


def test_the_token_comes_from_a_secret_read_with_the_kubeconfig(
    tessera_cli: Any, core: Any, namespace: str, cluster: Cluster
) -> None:
    token = base64.b64encode(cluster.admin_token.encode()).decode()
    core.create_namespaced_secret(
        namespace,
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tessera-cli"},
         "data": {"token": token}},
    )  # fmt: skip
    plain = {"TESSERA_TOKEN": "", "KUBECONFIG": ""}
    nodes = tessera_cli(
        "inspect", "-o", "json", "--kubeconfig", str(cluster.kubeconfig),
        "--token-secret", f"{namespace}/tessera-cli", env=plain,
    ).json()  # fmt: skip
    assert {n["name"] for n in nodes} >= set(NODES)
    missing = tessera_cli(
        "inspect", "--kubeconfig", str(cluster.kubeconfig),
        "--token-secret", f"{namespace}/nope", env=plain,
    )  # fmt: skip
    assert missing.code == 1
    assert missing.err == f"error: secret {namespace}/nope not found (--token-secret)\n"


class _PodStandIn(BaseHTTPRequestHandler):
    """Stands in for the control plane's pod behind its Service: what the API server's proxy
    sends arrives here and goes on to the harness's control plane on loopback (the API server
    proxies to no loopback address), as the request's Host the one the control plane allows."""

    target = ""
    seen: list[dict[str, str]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        self.seen.append(dict(self.headers))
        skip = {"host", "connection", "content-length", "transfer-encoding", "accept-encoding"}
        headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        request = urllib.request.Request(
            self.target + self.path, data=body, method=self.command, headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                status, data, kind = answer.status, answer.read(), answer.headers["Content-Type"]
        except urllib.error.HTTPError as refused:
            status, data, kind = refused.code, refused.read(), refused.headers["Content-Type"]
        self.send_response(status)
        self.send_header("Content-Type", kind or "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = _forward


def _outward_address() -> str:
    """This machine's address on its default route (not loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.254", 9))  # no packet is sent: this only picks the route
        except OSError:
            return ""
        address = str(probe.getsockname()[0])
    return "" if address.startswith("127.") else address


def test_without_a_server_it_goes_through_the_api_servers_service_proxy(
    tessera_cli: Any, core: Any, kube: Any, namespace: str, cluster: Cluster
) -> None:
    address = _outward_address()
    if not address:
        pytest.skip("no address but loopback here, and the API server proxies to none of those")
    _PodStandIn.target, _PodStandIn.seen = cluster.controlplane_url, []
    stand_in = ThreadingHTTPServer((address, 0), _PodStandIn)
    threading.Thread(target=stand_in.serve_forever, daemon=True).start()
    port = stand_in.server_address[1]
    try:
        # The chart's Service, named as the plugin's defaults name it, whose one endpoint is a
        # pod with the stand-in's address (the API server proxies only to pods' addresses); no
        # controller runs here to fill the endpoints in, nor a kubelet to run the pod.
        core.create_namespaced_pod(
            namespace,
            {"metadata": {"name": "tessera-stand-in"},
             "spec": {"schedulerName": "tessera-e2e-nobody", "automountServiceAccountToken": False,
                      "containers": [{"name": "app", "image": "registry.invalid/tessera:1"}]}},
        )  # fmt: skip
        core.patch_namespaced_pod_status(
            "tessera-stand-in",
            namespace,
            {"status": {"podIP": address, "podIPs": [{"ip": address}]}},
        )
        core.create_namespaced_service(
            namespace,
            {"metadata": {"name": "tessera"},
             "spec": {"ports": [{"name": "http", "port": 8000, "targetPort": port}]}},
        )  # fmt: skip
        target = {"kind": "Pod", "name": "tessera-stand-in", "namespace": namespace}
        client.DiscoveryV1Api(kube).create_namespaced_endpoint_slice(
            namespace,
            {"metadata": {"name": "tessera-1", "labels": {"kubernetes.io/service-name": "tessera"}},
             "addressType": "IPv4",
             "endpoints": [{"addresses": [address], "conditions": {"ready": True},
                            "targetRef": target}],
             "ports": [{"name": "http", "port": port, "protocol": "TCP"}]},
        )  # fmt: skip
        proxied = {"TESSERA_SERVER": ""}

        def through_the_proxy() -> Run | None:
            run = tessera_cli(
                "inspect", "-o", "json", "--tessera-namespace", namespace, env=proxied
            )
            return run if run.code == 0 or "no endpoints" not in run.err else None

        # The API server learns of the endpoints from a watch: a moment after they are made.
        done = objects.wait_for(
            through_the_proxy, timeout=30, what="the proxy's endpoints", every=1
        )
        assert {n["name"] for n in done.json()} >= set(NODES)
        # A write goes the same way, with the token in the header the API server passes on.
        tessera_cli("quota", "set", namespace, "--gpus", "3", "--tessera-namespace", namespace,
                    env=proxied).ok()  # fmt: skip
        assert tessera_cli("quota", "get", namespace, "-o", "json").json()[0]["gpus"] == 3
        assert _PodStandIn.seen and all(
            h.get("X-Tessera-Token") == cluster.admin_token for h in _PodStandIn.seen
        )
        refused = tessera_cli("inspect", "--tessera-namespace", namespace, "--token", "tsr_no",
                              env=proxied)  # fmt: skip
        assert refused.err.startswith("error: token refused (401): "), refused.err
    finally:
        stand_in.shutdown()
        stand_in.server_close()

    # With no Service there, the API server's answer says so and names what to check.
    run = tessera_cli(
        "inspect", "--tessera-namespace", "tessera-e2e-absent", env={"TESSERA_SERVER": ""}
    )
    assert run.code == 1, run.out
    # 404 or 503 ("no endpoints available for service"), depending on the API server's version.
    assert re.match(r"error: the API server's proxy to Tessera said (404|503): ", run.err), run.err
    assert '"tessera"' in run.err, run.err
    assert "check --tessera-namespace, --tessera-service and --tessera-port" in run.err


def test_errors_are_one_line_and_exit_non_zero(
    tessera_cli: Any, cluster: Cluster, namespace: str
) -> None:
    bad = tessera_cli("inspect", "--token", "tsr_not-a-real-token")
    assert bad.code == 1 and bad.out == ""
    assert bad.err.startswith("error: token refused (401): Invalid, revoked or expired token.")
    assert "viewer role" in bad.err

    viewer = cluster.manage("createtoken", "kubectl-viewer", "--role", "viewer").strip()
    refused = tessera_cli("quota", "set", namespace, "--gpus", "1", "--token", viewer)
    assert refused.code == 1
    assert refused.err.startswith("error: forbidden (403): ") and "operator role" in refused.err

    unknown = tessera_cli("why", "no-such-pod", "-n", namespace)
    assert unknown.code == 1
    assert unknown.err.startswith("error: not found (404): Tessera has no scheduling decision")

    assert tessera_cli("inspect", "no-such-node").err == (
        "error: not found (404): node 'no-such-node' is not registered with Tessera.\n"
    )
    card = tessera_cli("cordon", "GPU-no-such-card")
    assert card.code == 1 and card.err.startswith("error: not found (404): ")

    closed = f"http://127.0.0.1:{free_port()}"
    away = tessera_cli("inspect", "--server", closed)
    assert away.code == 1 and away.err.startswith(f"error: cannot reach Tessera at {closed}: ")

    usage = tessera_cli("quota", "set", namespace)
    assert usage.code == 2 and "give at least one of --gpumem" in usage.err
    for run in (bad, refused, unknown, card, away, usage):
        assert "Traceback" not in run.err


def test_mode_changes_a_cards_mode(tessera_cli: Any, core: Any, namespace: str) -> None:
    node, card, busy = NODES[5], f"GPU-{NODES[5]}-7", f"GPU-{NODES[5]}-6"
    run = tessera_cli("mode", card, "mps", "--reason", "kubectl plugin e2e")
    if run.code != 0 and "no API route" in run.err:
        pytest.skip(
            "this control plane has no POST /api/v1/cards/<uuid>/mode yet (docs/card-modes.md)"
        )
    try:
        assert run.ok().strip() == f"card/{card} mode mps"
        [answer] = tessera_cli("inspect", node, "-o", "json").json()
        [held] = [c for c in answer["cards"] if c["uuid"] == card]
        assert held["mode"] == "mps"
        assert _card_row(tessera_cli("inspect", node).ok(), card)[-5] == "mps"
    finally:
        tessera_cli("mode", card, "shared", "--reason", "kubectl plugin e2e").ok()

    # A card that holds a slice drains first; asking for its current mode cancels the change.
    pod = objects.gpu_pod("holder", gpumem=2000, annotations={PIN: busy})
    core.create_namespaced_pod(namespace, pod)
    _wait_phase(core, namespace, "holder", "Running")
    try:
        said = tessera_cli("mode", busy, "mps").ok().strip()
        assert said.startswith(f"card/{busy} draining: "), said
        row = _card_row(tessera_cli("inspect", node).ok(), busy)
        assert row[-5] == "shared" and row[-1] == "draining->mps", row
    finally:
        assert tessera_cli("mode", busy, "shared").ok().strip() == f"card/{busy} mode shared"
    assert _card_row(tessera_cli("inspect", node).ok(), busy)[-1] == "ok"
