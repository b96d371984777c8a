"""The built OCI images (images/build.sh), each started from its archive as a runtime would:
configuration (user, PATH, entry point, labels), the entry point's version and health paths.

The archives are built on first use (minutes cold, seconds warm; docs/e2e.md) and run with
buildah (chroot isolation, the host's network), so these tests need root, like the build.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import images
from e2e.ports import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def built() -> dict[str, images.Image]:
    try:
        return images.build()
    except images.ImageError as exc:
        pytest.fail(str(exc), pytrace=False)


def run(image: images.Image, *command: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        images.run_argv(image, *command, env=env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"{command} in {image.ref} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def revision() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.mark.parametrize("name", images.ALL)
def test_configuration(built: dict[str, images.Image], name: str) -> None:
    config: dict[str, Any] = images.config(built[name])["config"]  # type: ignore[assignment]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == built[name].tag
    # The tree's revision, or the one whose identical inputs built the cached image.
    assert len(labels["org.opencontainers.image.revision"].split("-")[0]) == 40
    user = config.get("User", "")
    if name == "nodeplugin":
        assert user == "0:0"  # host sockets and paths; the chart drops the capabilities
    else:
        assert user and not user.startswith("0"), f"{name} runs as root: {user!r}"
    if name != "pause":
        env = dict(item.split("=", 1) for item in config["Env"])
        assert env["PATH"].split(":")[0] in ("/opt/tessera/venv/bin", "/usr/local/sbin")
    assert config.get("Entrypoint") or config.get("Cmd")


def test_controlplane_version(built: dict[str, images.Image]) -> None:
    out = run(built["controlplane"], "python", "-m", "controlplane.version")
    assert out.startswith(f"tessera {built['controlplane'].tag} (revision ")
    assert "unknown" not in out


def test_controlplane_entry_points(built: dict[str, images.Image]) -> None:
    """Every process the chart starts from this image finds its program and its app."""
    image = built["controlplane"]
    env = {"TESSERA_ENV": "dev", "TESSERA_LOCAL_DIR": "/tmp/tessera"}
    assert "gunicorn" in run(image, "gunicorn", "--version")
    assert "granian" in run(image, "granian", "--version").lower()
    # The extender sidecar's command (granian through its server class, controlplane/sidecar.py).
    sidecar = run(image, "python", "-m", "controlplane.sidecar", "--version")
    assert sidecar.split()[-1] == run(image, "granian", "--version").split()[-1]
    assert "controlplane" in run(image, "celery", "-A", "controlplane.celery", "report", env=env)
    checked = run(image, "python", "manage.py", "check", env=env)
    assert "no issues" in checked


@contextlib.contextmanager
def serving(
    image: images.Image, port: int, env: dict[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    """The image's default command, gunicorn, with its bind address moved to a free port."""
    proc = subprocess.Popen(
        images.run_argv(
            image, "gunicorn", "controlplane.wsgi", f"--bind=127.0.0.1:{port}", env=env
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_controlplane_serves_health(built: dict[str, images.Image]) -> None:
    port = free_port()
    env = {"TESSERA_ENV": "dev", "TESSERA_LOCAL_DIR": "/tmp/tessera",
           "TESSERA_ALLOWED_HOSTS": "127.0.0.1"}  # fmt: skip
    with serving(built["controlplane"], port, env) as proc:
        deadline = time.monotonic() + 60
        body = b""
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    body = r.read()
                    break
            except OSError:
                time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
    assert b"ok" in body


def test_nodeplugin_version_and_shim(built: dict[str, images.Image]) -> None:
    image = built["nodeplugin"]
    out = run(image, "python", "-m", "nodeplugin", "--version")
    assert out.startswith(f"tessera-nodeplugin {image.tag} (revision ")
    # The generated kubelet API modules are in the image (the plugin imports them) and the
    # generator is not.
    run(image, "python", "-c", "import nodeplugin.pb, nodeplugin.servicer")
    argv = images.run_argv(image, "python", "-c", "import grpc_tools")
    missing = subprocess.run(argv, capture_output=True, check=False)
    assert missing.returncode != 0
    # What the chart's init container copies onto the host: the shim, a shared library.
    head = run(image, "sh", "-c", "head -c 4 /opt/tessera/lib/libtessera.so | od -An -c")
    assert "E   L   F" in head


def test_nodeplugin_refuses_without_settings(built: dict[str, images.Image]) -> None:
    """The entry point runs the plugin: without a control plane URL it stops with exit 2."""
    proc = subprocess.run(
        images.run_argv(built["nodeplugin"], "python", "-m", "nodeplugin"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "TESSERA_CONTROLPLANE_URL" in proc.stderr + proc.stdout


def test_gpu_test_probe(built: dict[str, images.Image]) -> None:
    """Without the node plugin's CDI spec the probe sees no devices and no shim, so nothing
    holds it to a slice: the allocation past 1 MiB succeeds (the real-node tests show the
    opposite on a slice)."""
    import json

    out = run(built["gpu-test"], "/usr/local/bin/gpu-probe", "--inside=1", "--beyond=2",
              "--spill=3")  # fmt: skip
    report = json.loads(out)
    assert report["cuInit"] == 0
    assert report["devices"] == [] and report["shim_mapped"] is False
    assert report["beyond"] == 0
    # which driver call served each: plain memory, nothing redirects it without the shim
    assert (report["inside_via"], report["spill"], report["spill_via"]) == ("alloc", 0, "alloc")
