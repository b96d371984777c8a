"""`make run` as a user runs it: the app server serves the admin and the inventory API."""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from e2e.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def wait_ready(url: str, proc: subprocess.Popen[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"make run exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    raise AssertionError("make run did not become ready in time")


def test_make_run_serves_admin_and_inventory_api(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DJANGO_"))}
    env.pop("DATABASE_URL", None)
    env.update(PORT=str(port), TESSERA_LOCAL_DIR=str(tmp_path / "state"), HOME=str(tmp_path))
    log = open(tmp_path / "run.log", "w+")  # noqa: SIM115 - read back after the server stops
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "run"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{base}/readyz", proc)
        log.seek(0)
        output = log.read()
        password = re.search(r"admin user 'admin', password: (\S+)", output)
        assert password, output
        assert "simulated GPU nodes registered" in output

        # The admin: sign in with the printed password and see the demo nodes.
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        login_page = opener.open(f"{base}/admin/login/").read().decode()
        assert "Tessera" in login_page
        css = re.search(r'href="(/static/admin/css/[^"]+\.css)"', login_page)
        assert css and opener.open(base + css.group(1)).status == 200
        # The CSRF token lives in the session (CSRF_USE_SESSIONS): read it from the form.
        token_field = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login_page)
        assert token_field, login_page
        csrf = token_field.group(1)
        form = urllib.parse.urlencode(
            {
                "username": "admin",
                "password": password.group(1),
                "csrfmiddlewaretoken": csrf,
                "next": "/admin/ledger/node/",
            }
        ).encode()
        request = urllib.request.Request(
            f"{base}/admin/login/", data=form, headers={"Referer": f"{base}/admin/login/"}
        )
        nodes_page = opener.open(request).read().decode()
        assert "demo-gpu-a100-0" in nodes_page and "demo-gpu-h100-0" in nodes_page

        # The inventory API with a node token made by the documented command.
        token = subprocess.run(
            [sys.executable, "manage.py", "createtoken", "gpu-real-1", "--role", "node"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.strip()
        body = json.dumps(
            {
                "plugin_version": "1.0",
                "cards": [
                    {
                        "uuid": "GPU-real-0",
                        "index": 0,
                        "model": "NVIDIA L4",
                        "memory_mib": 23034,
                        "numa_node": 0,
                        "healthy": True,
                        "health_reason": "",
                    }
                ],
            }
        ).encode()
        put = urllib.request.Request(
            f"{base}/api/v1/nodes/gpu-real-1/inventory",
            data=body,
            method="PUT",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(put) as response:
            assert response.status == 201
            assert json.load(response)["cards_added"] == ["GPU-real-0"]
        unauthenticated = urllib.request.Request(put.full_url, data=body, method="PUT")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(unauthenticated)
        assert err.value.code == 401
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
