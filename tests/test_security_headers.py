"""Security headers under the production settings (TESSERA_ENV=production), in a process of their
own: HSTS only on HTTPS (the control plane's TLS or the trusted proxy's X-Forwarded-Proto), the
Content-Security-Policy always, secure cookies. The development settings' side is in
tests/dashboard/test_headers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

ROOT = Path(__file__).resolve().parent.parent

# Migrate a fresh SQLite database and collect the static files once (production serves them from
# WhiteNoise's manifest), then fetch the sign-in page three ways and print what came back.
PROBE = """
import json, django
django.setup()
from django.conf import settings
from django.core.management import call_command
from django.test import Client
call_command("migrate", verbosity=0)
if not (settings.STATIC_ROOT / "staticfiles.json").exists():
    call_command("collectstatic", interactive=False, verbosity=0)
out = {}
for name, extra in {"https": {"secure": True}, "http": {},
                    "forwarded": {"HTTP_X_FORWARDED_PROTO": "https"}}.items():
    response = Client().get("/login/", **extra)
    out[name] = {
        "status": response.status_code,
        "hsts": response.get("Strict-Transport-Security"),
        "csp": response.get("Content-Security-Policy"),
        "cookies": {k: bool(v["secure"]) for k, v in response.cookies.items()},
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def local_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("production")
    (path / "kubeconfig").write_text("apiVersion: v1\nkind: Config\n")
    return path


def production(local_dir: Path, **env: str) -> dict[str, Any]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "KUBE"))}
    clean.pop("DATABASE_URL", None)
    clean.update(
        DJANGO_SETTINGS_MODULE="controlplane.settings",
        TESSERA_ENV="production",
        TESSERA_SECRET_KEY="p" * 64,
        TESSERA_LOCAL_DIR=str(local_dir),
        TESSERA_ALLOWED_HOSTS="testserver",
        KUBECONFIG=str(local_dir / "kubeconfig"),
        HOME=str(local_dir),
        **env,
    )
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_hsts_on_https_only_and_the_policy_everywhere(local_dir: Path) -> None:
    seen = production(local_dir)
    assert seen["https"]["status"] == 200
    assert seen["https"]["hsts"] == "max-age=31536000"
    assert seen["http"]["hsts"] is None  # never on plain HTTP (probes, port-forward)
    assert seen["forwarded"]["hsts"] is None  # the header is not trusted unless told to
    for how in ("https", "http", "forwarded"):
        assert "script-src 'self'" in seen[how]["csp"] and "unsafe" not in seen[how]["csp"]
    assert seen["https"]["cookies"] and all(seen["https"]["cookies"].values())


def test_behind_the_tls_proxy_its_https_gets_hsts(local_dir: Path) -> None:
    seen = production(local_dir, TESSERA_BEHIND_TLS_PROXY="1")
    assert seen["forwarded"]["hsts"] == "max-age=31536000"
    assert seen["http"]["hsts"] is None


def test_hsts_is_configurable(local_dir: Path) -> None:
    seen = production(
        local_dir,
        TESSERA_HSTS_SECONDS="600",
        TESSERA_HSTS_INCLUDE_SUBDOMAINS="1",
        TESSERA_HSTS_PRELOAD="yes",
    )
    assert seen["https"]["hsts"] == "max-age=600; includeSubDomains; preload"
    assert production(local_dir, TESSERA_HSTS_SECONDS="0")["https"]["hsts"] is None


@pytest.mark.django_db
def test_no_hsts_outside_production() -> None:
    response = Client().get("/login/", secure=True)
    assert response.status_code == 200
    assert "Strict-Transport-Security" not in response
    assert "Content-Security-Policy" in response
