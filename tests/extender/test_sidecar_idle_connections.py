"""The extender sidecar keeps an idle keep-alive connection longer than kube-scheduler does.

kube-scheduler's extender client keeps idle connections for 90 s (Go's http.Transport
`IdleConnTimeout`, applied by k8s.io/apimachinery's `SetTransportDefaults`) and never retries a
POST that fails on one. granian closes a connection idle for its header-read timeout (30 s by
default): a filter sent on a connection the sidecar is closing that instant fails, and the pod's
scheduling cycle with it. Here the sidecar runs with the command of
deploy/scheduler/deployment.yaml, as the e2e harness and the benchmark run it.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.manifests import deployed_extender_command, sidecar_argv
from e2e.ports import free_port
from e2e.processes import stop_process_tree
from tests.pods import gpu_container, pod_json

ROOT = Path(__file__).resolve().parents[2]
# kube-scheduler's idle-connection timeout (Go's http.DefaultTransport.IdleConnTimeout).
SCHEDULER_IDLE_CONN_S = 90
IDLE_S = SCHEDULER_IDLE_CONN_S + 5  # longer than kube-scheduler ever holds a connection idle


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[int]:
    """The sidecar as the deployment runs it, on a free loopback port, over a fresh SQLite
    database and the embedded stand-in; yields its port."""
    found = deployed_extender_command()
    assert found is not None, "deploy/scheduler/deployment.yaml has no extender command"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DJANGO_"))}
    env.update(
        DATABASE_URL=f"sqlite:///{tmp_path / 'sidecar.sqlite3'}",
        TESSERA_LOCAL_DIR=str(tmp_path),
        TESSERA_KUBE_MODE="embedded",
        TESSERA_SERVE_EXTENDER="1",
        TESSERA_ALLOCATION_KEY="idle-connection-test-key-0123456789abcdef",
        DJANGO_SETTINGS_MODULE="controlplane.settings",
    )
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=ROOT, env=env, check=True,
    )  # fmt: skip
    log_path = tmp_path / "sidecar.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            sidecar_argv(found[0], port, found[1]),
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the sidecar exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"the sidecar never answered:\n{log_path.read_text()}"
            )
            try:
                probe = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                probe.request("GET", "/readyz")
                if probe.getresponse().status == 200:
                    probe.close()
                    break
            except OSError:
                pass
            time.sleep(0.2)
        yield port
    finally:
        stop_process_tree(proc.pid, timeout_s=15)
        proc.wait(timeout=5)


def _filter(conn: http.client.HTTPConnection, name: str) -> dict:
    pod = pod_json(name, uid=f"uid-{name}", containers=[gpu_container("c", gpus=1, mem=1000)])
    body = json.dumps({"Pod": pod, "NodeNames": ["gpu-0"]}).encode()
    conn.request(
        "POST", "/scheduler/filter", body=body, headers={"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    answer = response.read()
    assert response.status == 200, answer
    assert not response.will_close, "the sidecar asked to close the connection"
    return json.loads(answer)


def test_the_sidecar_takes_granians_options_and_a_longer_header_read_timeout() -> None:
    """granian's own command line refuses more than 60,000 ms; the sidecar takes it, and the
    manifests' other options by granian's names, and gives them to granian's server class."""
    import click
    from granian.cli import cli as granian_cli
    from granian.constants import HTTPModes, Interfaces

    from controlplane.sidecar import server

    found = deployed_extender_command()
    assert found is not None
    argv = found[0][3:]  # after `python -m controlplane.sidecar`
    assert "--http1-header-read-timeout=120000" in argv
    with pytest.raises(click.BadParameter, match="60000"):
        granian_cli.make_context("granian", list(argv))
    granian = server(argv)
    assert granian.http1_settings.header_read_timeout == 120000
    assert granian.target == "controlplane.wsgi:application"
    assert granian.interface == Interfaces.WSGI and granian.http == HTTPModes.http1
    assert (granian.bind_addr, granian.bind_port) == ("127.0.0.1", 8001)
    assert granian.workers == 1 and granian.blocking_threads == 16
    assert granian.blocking_threads_idle_timeout == 300 and not granian.websockets
    with pytest.raises(SystemExit):  # an option it does not know is refused, not ignored
        server([*argv[:-1], "--runtime-threads=2", argv[-1]])


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://")),
    reason="about the HTTP server, not the database: runs once, in the SQLite pass",
)
def test_a_filter_on_a_connection_idle_longer_than_the_schedulers_timeout_succeeds(
    sidecar: int,
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", sidecar, timeout=10)
    try:
        first = _filter(conn, "before-idle")
        assert first["Error"] == ""
        sock = conn.sock
        time.sleep(IDLE_S)
        try:
            second = _filter(conn, "after-idle")
        except (http.client.RemoteDisconnected, ConnectionError) as exc:
            pytest.fail(f"the sidecar closed a connection idle for {IDLE_S} s: {exc!r}")
        assert conn.sock is sock, "the filter went over a new connection"
        assert second["Error"] == ""
        # No node is registered: unresolvable, with a reason, and nothing failed.
        assert "gpu-0" in second["FailedAndUnresolvableNodes"]
    finally:
        conn.close()
