"""Who may reach the extender (loopback sidecar only), and the allocation key's sources."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane.ledger import allocation
from tests.extender.builders import filter_args
from tests.extender.conftest import post
from tests.pods import gpu_pod

ROOT = Path(__file__).resolve().parent.parent.parent
VERBS = ["/scheduler/filter", "/scheduler/prioritize", "/scheduler/preempt", "/scheduler/bind"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", VERBS)
def test_replicas_that_do_not_serve_the_extender_answer_404(client, settings, path) -> None:
    settings.TESSERA = {**settings.TESSERA, "SERVE_EXTENDER": False}
    response = post(client, path, filter_args(gpu_pod(), ["n1"]))
    assert response.status_code == 404 and "not served" in response.json()["Error"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", VERBS)
@pytest.mark.parametrize("peer", ["10.0.0.7", "192.168.1.1", "::ffff:10.0.0.1", "", "garbage"])
def test_the_extender_answers_only_loopback_peers(client, path, peer) -> None:
    response = post(client, path, filter_args(gpu_pod(), ["n1"]), REMOTE_ADDR=peer)
    assert response.status_code == 403 and "loopback" in response.json()["Error"]


@pytest.mark.django_db
@pytest.mark.parametrize("peer", ["127.0.0.1", "127.8.9.10", "::1"])
def test_loopback_peers_are_served(client, peer) -> None:
    response = post(client, "/scheduler/filter", filter_args(gpu_pod(), ["n1"]), REMOTE_ADDR=peer)
    assert response.status_code == 200


@pytest.mark.django_db
def test_forwarded_headers_do_not_make_a_remote_peer_local(client) -> None:
    response = post(
        client,
        "/scheduler/filter",
        filter_args(gpu_pod(), ["n1"]),
        REMOTE_ADDR="10.0.0.7",
        HTTP_X_FORWARDED_FOR="127.0.0.1",
        HTTP_X_REAL_IP="127.0.0.1",
    )
    assert response.status_code == 403


def load_app(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "KUBE"))}
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    clean.update(
        TESSERA_LOCAL_DIR=str(tmp_path),
        HOME=str(tmp_path),
        TESSERA_ENV="production",
        TESSERA_SECRET_KEY="s" * 64,
        KUBECONFIG=str(kubeconfig),
        DJANGO_SETTINGS_MODULE="controlplane.settings",
    )
    clean.update(env)
    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); print('started')"],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_production_extender_refuses_to_start_without_a_key_file(tmp_path) -> None:
    result = load_app(tmp_path, TESSERA_SERVE_EXTENDER="1")
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert "TESSERA_ALLOCATION_KEY_FILE" in result.stderr
    # the dev/test variable is not accepted in production either
    plain = load_app(tmp_path, TESSERA_SERVE_EXTENDER="1", TESSERA_ALLOCATION_KEY="k" * 40)
    assert plain.returncode != 0 and "TESSERA_ALLOCATION_KEY_FILE" in plain.stderr


def test_a_production_extender_starts_with_a_key_file(tmp_path) -> None:
    key = tmp_path / "allocation.key"
    key.write_text("x" * 48 + "\n")
    result = load_app(tmp_path, TESSERA_SERVE_EXTENDER="1", TESSERA_ALLOCATION_KEY_FILE=str(key))
    assert result.returncode == 0, result.stderr
    short = tmp_path / "short.key"
    short.write_text("tiny")
    refused = load_app(tmp_path, TESSERA_SERVE_EXTENDER="1", TESSERA_ALLOCATION_KEY_FILE=str(short))
    assert refused.returncode != 0 and "at least 32" in refused.stderr


def test_ordinary_production_replicas_need_no_signing_key(tmp_path) -> None:
    assert load_app(tmp_path).returncode == 0


@pytest.fixture
def key_settings(settings):
    allocation.reset_key()
    yield settings
    allocation.reset_key()


def test_key_file_wins_and_whitespace_is_stripped(key_settings, tmp_path) -> None:
    path = tmp_path / "k"
    path.write_bytes(b"  " + b"f" * 40 + b"\n")
    key_settings.TESSERA = {**key_settings.TESSERA, "ALLOCATION_KEY_FILE": str(path)}
    assert allocation.key() == b"f" * 40


def test_dev_without_a_key_generates_one_once_and_keeps_it(key_settings, tmp_path) -> None:
    key_settings.LOCAL_DIR = tmp_path
    key_settings.TESSERA = {**key_settings.TESSERA, "ALLOCATION_KEY": ""}
    first = allocation.key()
    allocation.reset_key()
    assert allocation.key() == first and len(first) >= 32
    assert (tmp_path / "allocation.key").stat().st_mode & 0o777 == 0o600


def test_a_short_dev_key_is_refused(key_settings) -> None:
    key_settings.TESSERA = {**key_settings.TESSERA, "ALLOCATION_KEY": "short"}
    with pytest.raises(ImproperlyConfigured, match="at least 32"):
        allocation.key()
