"""Probes, and settings that refuse unsafe production configurations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.django_db
def test_healthz_and_readyz(client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["database"] == "ok"


@pytest.mark.django_db
def test_readyz_fails_when_the_database_is_unreachable(client, monkeypatch) -> None:
    def broken_cursor(*args, **kwargs):
        raise connection.OperationalError("connection refused")  # type: ignore[attr-defined]

    monkeypatch.setattr(connection, "cursor", broken_cursor)
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["database"] == "unreachable"


def load_settings(**env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "KUBE"))}
    clean.update(env, DJANGO_SETTINGS_MODULE="controlplane.settings")
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); from django.conf import settings;"
            " print(settings.TESSERA['KUBE_MODE'], settings.DATABASES['default']['ENGINE'])",
        ],
        cwd=ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_defaults_are_embedded_and_sqlite(tmp_path) -> None:
    result = load_settings(TESSERA_LOCAL_DIR=str(tmp_path), HOME=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["embedded", "django.db.backends.sqlite3"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TESSERA_ENV": "production"}, "TESSERA_SECRET_KEY"),
        ({"TESSERA_ENV": "production", "TESSERA_SECRET_KEY": "short"}, "TESSERA_SECRET_KEY"),
        ({"TESSERA_ENV": "production", "TESSERA_SECRET_KEY": "k" * 60}, "embedded"),
        ({"TESSERA_ENV": "staging"}, "TESSERA_ENV"),
        ({"DATABASE_URL": "mysql://x/y"}, "DATABASE_URL"),
        ({"TESSERA_DEFAULT_SLOTS": "lots"}, "TESSERA_DEFAULT_SLOTS"),
        ({"TESSERA_DEFAULT_GPUCORES": "101"}, "TESSERA_DEFAULT_GPUCORES"),
        ({"TESSERA_KUBE_MODE": "kubeconfig", "KUBECONFIG": "/nonexistent"}, "KUBECONFIG"),
        ({"TESSERA_CSRF_TRUSTED_ORIGINS": "gpus.example.com"}, "https://gpus.example.com"),
        ({"TESSERA_BEHIND_TLS_PROXY": "maybe"}, "TESSERA_BEHIND_TLS_PROXY"),
        ({"TESSERA_ADOPTED_SCHEDULERS": "default-scheduler,Volcano"}, "'Volcano' is not"),
        ({"TESSERA_ADOPTED_SCHEDULERS": "a b"}, "TESSERA_ADOPTED_SCHEDULERS"),
        ({"TESSERA_DEFAULT_VGPU_MODES": "hami-core,vmware"}, "TESSERA_DEFAULT_VGPU_MODES"),
        ({"TESSERA_DEFAULT_VGPU_MODES": ","}, "TESSERA_DEFAULT_VGPU_MODES"),
        ({"TESSERA_MIG_RESOURCES": "maybe"}, "TESSERA_MIG_RESOURCES"),
        (
            {"TESSERA_CARD_MODE_DEFAULTS": '[{"model": "A100", "mode": "vgpu"}]'},
            "TESSERA_CARD_MODE_DEFAULTS[0].mode: 'vgpu' is not a card mode",
        ),
    ],
)
def test_unsafe_or_bad_settings_are_refused_with_a_clear_message(tmp_path, env, message) -> None:
    result = load_settings(TESSERA_LOCAL_DIR=str(tmp_path), HOME=str(tmp_path), **env)
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and message in result.stderr


def test_production_with_key_and_kubeconfig_loads(tmp_path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    result = load_settings(
        TESSERA_LOCAL_DIR=str(tmp_path),
        HOME=str(tmp_path),
        TESSERA_ENV="production",
        TESSERA_SECRET_KEY="s" * 64,
        KUBECONFIG=str(kubeconfig),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "kubeconfig"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{not json", "not JSON"),
        ('{"model": "A100", "mode": "mig"}', "expected a JSON list"),
        ('[{"model": "A100"}]', '[0]: expected an object with exactly "model" and "mode"'),
        ('[{"model": "A100", "mode": "mig", "x": 1}]', "[0]: expected an object with exactly"),
        ('[{"model": "A100", "mode": "mig"}, {"model": "", "mode": "mps"}]', "[1].model"),
        ('[{"model": 7, "mode": "mps"}]', "[0].model"),
        ('[{"model": "L4", "mode": "MPS"}]', "[0].mode: 'MPS' is not a card mode"),
        (json.dumps([{"model": "a", "mode": "mps"}] * 65), "at most 64 rules"),
    ],
)
def test_card_mode_defaults_are_validated_naming_the_rule(monkeypatch, raw, message) -> None:
    from django.core.exceptions import ImproperlyConfigured

    from controlplane.settings import env_card_mode_defaults

    monkeypatch.setenv("TESSERA_CARD_MODE_DEFAULTS", raw)
    with pytest.raises(ImproperlyConfigured) as err:
        env_card_mode_defaults("TESSERA_CARD_MODE_DEFAULTS")
    assert str(err.value).startswith("TESSERA_CARD_MODE_DEFAULTS") and message in str(err.value)


def test_card_mode_defaults_read_in_order_and_the_modes_match_the_ledger(monkeypatch) -> None:
    from controlplane.ledger.models import Card
    from controlplane.settings import CARD_MODES, env_card_mode_defaults

    assert tuple(Card.Mode.values) == CARD_MODES
    monkeypatch.setenv(
        "TESSERA_CARD_MODE_DEFAULTS",
        '[{"model": " A100 ", "mode": "mig"}, {"model": "H100", "mode": "exclusive"}]',
    )
    assert env_card_mode_defaults("TESSERA_CARD_MODE_DEFAULTS") == (
        {"model": "A100", "mode": "mig"},
        {"model": "H100", "mode": "exclusive"},
    )
    monkeypatch.setenv("TESSERA_CARD_MODE_DEFAULTS", "")
    assert env_card_mode_defaults("TESSERA_CARD_MODE_DEFAULTS") == ()
