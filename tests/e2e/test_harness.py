"""The harness itself: a real cluster comes up, kwok runs nodes, failures stop everything."""

from __future__ import annotations

import contextlib
import http.client
import os
import secrets
import signal
import socket
import ssl
import stat
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from e2e import objects
from e2e.cluster import Cluster, Options
from e2e.database import ScratchDatabase
from e2e.harness import HarnessError, load_versions
from e2e.manifests import deployed_extender_command, sidecar_argv, sidecar_server
from e2e.processes import ended, processes_of_run, stop_process_tree
from tests.e2e.conftest import NODES, chart_values


def test_the_control_plane_runs_on_the_database_the_session_asked_for(
    cluster: Cluster, database: ScratchDatabase | None
) -> None:
    code = "from django.db import connection as c; print('db:', c.vendor, c.settings_dict['NAME'])"
    said = cluster.manage("shell", "--no-startup", "--command", code)
    [line] = [x for x in said.splitlines() if x.startswith("db: ")]  # past any log line
    _, vendor, name = line.split(" ", 2)
    if database is None:
        assert vendor == "sqlite" and name.startswith(str(cluster.run_dir))
    else:
        assert (vendor, name) == ("postgresql", database.name)


def test_every_component_is_up_at_the_pinned_version(cluster: Cluster, kube: Any) -> None:
    from kubernetes import client

    status = {line.split()[0]: line.split()[1] for line in cluster.status()}
    for name in ("etcd", "kube-apiserver", "controlplane", "webhook", "extender",
                 "kube-scheduler", "kwok"):  # fmt: skip
        assert status.get(name) == "up", cluster.status()
    version = client.VersionApi(kube).get_code()
    assert version.git_version == load_versions()["KUBERNETES_VERSION"]


def test_kwok_runs_the_simulated_gpu_nodes(
    cluster: Cluster, core: Any, gpu_nodes: dict[str, Any]
) -> None:
    shared = "type=kwok,tessera.io/e2e-pool=shared"
    nodes = {n.metadata.name: n for n in core.list_node(label_selector=shared).items}
    assert sorted(nodes) == sorted(NODES)
    for node in nodes.values():
        # 8 cards x 10 slots, under the node plugin's name (the chart's in chart mode)
        assert node.status.allocatable[cluster.node_resource] == "80"
        assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"


def test_inventory_goes_through_the_real_rest_api_with_node_tokens(
    gpu_nodes: dict[str, Any], tessera: objects.Tessera, node_tokens: dict[str, str]
) -> None:
    for response in gpu_nodes.values():
        assert response.status_code == 201, response.text
        assert response.json()["cards"] == 8
    # A heartbeat (same report again) answers 200; a node may not report another node.
    again = tessera.with_token(node_tokens[NODES[0]]).report_inventory(
        NODES[0], objects.inventory(NODES[0])
    )
    assert again.status_code == 200 and again.json()["created"] is False
    other = tessera.with_token(node_tokens[NODES[0]]).report_inventory(
        NODES[1], objects.inventory(NODES[1])
    )
    assert other.status_code == 403


def test_a_pod_without_gpus_runs_on_kwok_through_the_default_scheduler(
    core: Any, gpu_nodes: dict[str, Any], namespace: str
) -> None:
    core.create_namespaced_pod(namespace, objects.plain_pod("plain"))

    def running() -> Any:
        pod = core.read_namespaced_pod("plain", namespace)
        return pod if pod.status.phase == "Running" else None

    pod = objects.wait_for(running, timeout=60, what="the plain pod to run")
    assert pod.spec.node_name in NODES
    assert pod.spec.scheduler_name == "default-scheduler"


# --- failures: a clear message, and nothing of the harness left running ------------------------

# Each of these brings up a partial cluster of its own with the harness's defaults: the chart
# changes nothing they check, so the chart-mode pass (make e2e-chart) leaves them to the default.
not_in_chart_mode = pytest.mark.skipif(
    bool(chart_values()),
    reason="harness failure handling does not depend on the chart: run in the default pass",
)


def _failing_up(tmp_path: Path, binaries: dict[str, Path], **options: Any) -> tuple[str, str]:
    harness = Cluster(
        Options(run_dir=tmp_path / "run", binaries=binaries, ready_timeout_s=30, **options)
    )
    with pytest.raises(HarnessError) as failure:
        harness.up()
    harness.load_state()
    run_id = harness.state["run_id"]
    assert harness.state["components"] == {}, "down() should have emptied the component list"
    assert processes_of_run(run_id) == [], "a process of the failed run is still alive"
    return str(failure.value), run_id


@not_in_chart_mode
def test_a_taken_port_names_the_component_and_stops_the_others(
    tmp_path: Path, binaries: dict[str, Path]
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        message, _ = _failing_up(tmp_path, binaries, ports={"kube-scheduler": port})
    assert "kube-scheduler" in message
    assert f"127.0.0.1:{port} is already in use" in message


@not_in_chart_mode
def test_a_missing_binary_names_itself_and_stops_the_others(
    tmp_path: Path, binaries: dict[str, Path]
) -> None:
    wrong = {**binaries, "kwok": tmp_path / "no-such-kwok"}
    message, _ = _failing_up(tmp_path, wrong)
    assert f"kwok: binary {tmp_path / 'no-such-kwok'} is missing" in message


@not_in_chart_mode
def test_a_component_that_dies_at_start_shows_its_log(
    tmp_path: Path, binaries: dict[str, Path]
) -> None:
    dying = tmp_path / "kube-scheduler"
    dying.write_text("#!/bin/sh\necho 'scheduler: cannot load config, giving up' >&2\nexit 3\n")
    dying.chmod(dying.stat().st_mode | stat.S_IXUSR)
    message, _ = _failing_up(tmp_path, {**binaries, "kube-scheduler": dying})
    assert "kube-scheduler exited with code 3 before it was ready" in message
    assert "cannot load config, giving up" in message


def test_the_extender_sidecar_runs_the_deployments_command(cluster: Cluster) -> None:
    """kube-scheduler reaches Tessera through a process started with the sidecar's command of
    the deployment (the chart's in chart mode), its listening address the one change."""
    chart = cluster.options.chart
    found = deployed_extender_command()
    assert found is not None
    wanted = list(chart.extender_command) if chart is not None else found[0]
    server, module, args = sidecar_server(wanted, "the manifest")
    running = psutil.Process(cluster.state["components"]["extender"]["pid"]).cmdline()
    argv = [a for a in running if a and a != "--access-log"]
    assert argv[1:3] == ["-m", module]
    port = cluster.ports["extender"]
    assert argv[3:] == [f"--port={port}" if a.startswith("--port=") else a for a in args]
    assert server == "granian"  # the server docs/extender.md measured


def test_the_webhook_keeps_an_idle_connection_open(cluster: Cluster) -> None:
    """The API server reuses idle webhook connections for up to 90 s; a listener that closed
    them after gunicorn's default 2 s failed pod creates with "write: broken pipe"."""
    context = ssl.create_default_context(cafile=str(cluster.pki / "ca.crt"))
    conn = http.client.HTTPSConnection(
        "127.0.0.1", cluster.ports["webhook"], context=context, timeout=10
    )
    sockets = []
    try:
        for pause in (0.0, 4.0):  # twice gunicorn's default keep-alive, then the same socket
            time.sleep(pause)
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
            assert resp.status == 200
            resp.read()
            assert not resp.will_close
            sockets.append(conn.sock)
        assert sockets[0] is sockets[1]
    finally:
        conn.close()


def test_64_gpu_pods_created_at_once_all_pass_the_webhook_at_once(
    cluster: Cluster, core: Any, namespace: str
) -> None:
    """A Job's worth of GPU pods created at once: the API server opens a webhook connection per
    create in flight, and each new connection holds one of gunicorn's threads until its first
    request. With fewer threads than connections the calls wait out the API server's 5 s
    webhook timeout and the creates fail; with the chart's threads every pod is admitted
    (mutated) at once."""
    api = objects.Api(cluster)
    pods = 64
    nowhere = {"kubernetes.io/hostname": "no-such-node"}  # pending: no scheduler work meanwhile

    def create(i: int) -> tuple[float, str]:
        pod = objects.gpu_pod(f"burst-{i}", gpumem=1024)
        pod["spec"]["nodeSelector"] = nowhere
        start = time.monotonic()
        try:
            api.post(f"/api/v1/namespaces/{namespace}/pods", pod)
        except RuntimeError as exc:
            return time.monotonic() - start, str(exc)
        return time.monotonic() - start, ""

    try:
        with ThreadPoolExecutor(pods) as pool:
            results = list(pool.map(create, range(pods)))
        errors = [e for _, e in results if e]
        assert not errors, f"{len(errors)} of {pods} creates failed, e.g. {errors[0]}"
        slowest = max(t for t, _ in results)
        assert slowest < 4.0, f"the slowest create took {slowest:.2f} s (webhook timeout: 5 s)"
        listed = core.list_namespaced_pod(namespace).items
        assert len(listed) == pods
        # Every one went through the webhook, which hands GPU pods to Tessera's scheduler.
        assert {p.spec.scheduler_name for p in listed} == {"tessera-scheduler"}
    finally:
        core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)


def test_the_sidecar_command_is_pointed_at_the_harness_port_or_refused() -> None:
    argv = sidecar_argv(["granian", "--host=0.0.0.0", "--port=8001", "app:application"], 9, "x")
    assert argv[1:] == ["-m", "granian", "--host=127.0.0.1", "--port=9", "app:application"]
    argv = sidecar_argv(["gunicorn", "app", "--bind=0.0.0.0:8001"], 9, "x")
    assert argv[1:] == ["-m", "gunicorn", "app", "--bind=127.0.0.1:9"]
    argv = sidecar_argv(["python", "-m", "controlplane.sidecar", "--port=1", "app"], 9, "x")
    assert argv[1:] == ["-m", "controlplane.sidecar", "--port=9", "app"]
    with pytest.raises(HarnessError, match="x: the command \\['uvicorn'\\] is not granian"):
        sidecar_argv(["uvicorn", "--port=1", "app"], 9, "x")
    with pytest.raises(HarnessError, match="\\['python', '-m', 'uvicorn'\\] is not granian"):
        sidecar_argv(["python", "-m", "uvicorn", "--port=1", "app"], 9, "x")
    with pytest.raises(HarnessError, match="x: --port without =value"):
        sidecar_argv(["granian", "--port", "8001", "app"], 9, "x")
    with pytest.raises(HarnessError, match="x: the command sets no --port= or --bind="):
        sidecar_argv(["granian", "app"], 9, "x")


# --- stopping: a component and its descendants, by pid; never a process group -----------------


def _pid_in(path: Path, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.02)
    return int(path.read_text())


def _gone(pid: int, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while not ended(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _harness_without_cluster(tmp_path: Path) -> Cluster:
    harness = Cluster(Options(run_dir=tmp_path / "run"))
    harness.logs.mkdir(parents=True)
    harness.state = {"run_id": secrets.token_hex(8), "ports": {}, "components": {}}
    return harness


# A component that starts a child (which starts one of its own), and leaves one process in its
# process group that is not its descendant: forked by a subshell that exits at once, so it is
# re-parented away from the component, and started without the run's id. Its process group is
# the component's (the harness starts each component as a session and group leader), so a
# stop by process group would end it with the rest.
COMPONENT = """
sh -c 'sleep 300 & echo $! > grandchild.pid; wait' &
echo $! > child.pid
( env -u TESSERA_E2E_RUN_ID sleep 301 & echo $! > stray.pid )
wait
"""


@pytest.mark.parametrize("how", ["stop_component", "down"])
def test_stop_ends_the_component_and_its_descendants_and_no_other_process_of_its_group(
    tmp_path: Path, how: str
) -> None:
    harness = _harness_without_cluster(tmp_path)
    harness._spawn("toy", ["/bin/sh", "-c", COMPONENT], port_names=(), cwd=tmp_path)
    component = harness.state["components"]["toy"]["pid"]
    child, grandchild = _pid_in(tmp_path / "child.pid"), _pid_in(tmp_path / "grandchild.pid")
    stray = _pid_in(tmp_path / "stray.pid")
    try:
        assert os.getpgid(stray) == os.getpgid(component) == component
        assert not ended(stray) and not ended(grandchild)
        if how == "down":
            harness.down(quiet=True)
        else:
            harness.stop_component("toy")
        for pid in (component, child, grandchild):
            assert _gone(pid), f"process {pid} of the component outlived its stop"
        assert not ended(stray), "a process of the group that is not the component's was stopped"
        assert "toy" not in harness.state["components"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stray, signal.SIGKILL)


def test_descendants_that_ignore_sigterm_are_killed_after_the_timeout_even_orphaned(
    tmp_path: Path,
) -> None:
    """The component ends at once on SIGTERM; its child ignores SIGTERM and, orphaned, is no
    longer anyone's descendant: it is still known by its pid, and killed at the deadline."""
    (tmp_path / "deaf.sh").write_text("trap '' TERM\nsleep 300 &\necho $! > deaf.pid\nwait\n")
    proc = subprocess.Popen(["/bin/sh", "-c", "/bin/sh deaf.sh & wait"], cwd=tmp_path)
    deaf = _pid_in(tmp_path / "deaf.pid")
    try:
        started = time.monotonic()
        assert stop_process_tree(proc.pid, timeout_s=1.0) is True
        assert time.monotonic() - started >= 1.0
        proc.wait(timeout=5)
        assert _gone(deaf)
        assert stop_process_tree(proc.pid, timeout_s=1.0) is False  # nothing left to stop
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(deaf, signal.SIGKILL)
        proc.wait(timeout=5)


def test_kill_component_crashes_it_sigkill_at_once_to_every_descendant(tmp_path: Path) -> None:
    """A crash, not a stop: no SIGTERM first (the component would run its shutdown), and no
    waiting out a grace period for a descendant that would ignore one."""
    (tmp_path / "deaf.sh").write_text("trap '' TERM\nsleep 300 &\necho $! > deaf.pid\nwait\n")
    harness = _harness_without_cluster(tmp_path)
    harness._spawn("toy", ["/bin/sh", "-c", "/bin/sh deaf.sh & wait"], port_names=(), cwd=tmp_path)
    proc = harness._procs["toy"]
    deaf = _pid_in(tmp_path / "deaf.pid")
    try:
        started = time.monotonic()
        assert harness.kill_component("toy") == proc.pid
        assert proc.returncode == -signal.SIGKILL, proc.returncode
        assert _gone(deaf, timeout=1.0)
        assert time.monotonic() - started < 2.0
        assert "toy" not in harness.state["components"]
        assert harness.kill_component("toy") is None  # nothing left to kill
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(deaf, signal.SIGKILL)
