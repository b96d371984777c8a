"""The chart's card-mode values reach every control-plane process as the settings they name, in
a form the control plane reads back (docs/card-modes.md), and the values schema refuses bad ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from controlplane.settings import env_card_mode_defaults
from tests.deploy.chart import CHART, KUBE_VERSION, RELEASE, render, run_helm

pytestmark = pytest.mark.usefixtures("helm")
SETTINGS = ("TESSERA_CARD_MODE_DEFAULTS", "TESSERA_MIG_RESOURCES", "TESSERA_DEFAULT_VGPU_MODES")
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def card_mode_env(docs: list[dict[str, Any]]) -> dict[str, tuple[str, ...]]:
    """Per container that runs the control plane's Django code (it holds TESSERA_SECRET_KEY):
    the three settings' values."""
    out = {}
    for doc in docs:
        if doc["kind"] not in WORKLOADS:
            continue
        spec = doc["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if "TESSERA_SECRET_KEY" in env:
                out[f"{doc['metadata']['name']}/{c['name']}"] = tuple(env.get(k) for k in SETTINGS)
    return out


def test_defaults_render_no_rules_no_mig_resources_and_hami_core() -> None:
    rendered = card_mode_env(render())
    # web, webhook, worker, beat, scheduler extender, migrations: each reads the settings
    assert len(rendered) >= 5, rendered
    assert set(rendered.values()) == {("[]", "0", "hami-core")}


def test_values_render_as_the_settings_the_control_plane_reads(monkeypatch: Any) -> None:
    rendered = card_mode_env(
        render(
            sets=(
                "cardModes.defaults[0].model=A100",
                "cardModes.defaults[0].mode=mig",
                "cardModes.defaults[1].model=NVIDIA L4",
                "cardModes.defaults[1].mode=mps",
                "cardModes.migResources=true",
                "cardModes.defaultVgpuModes=hami-core\\,mig",
            )
        )
    )
    assert len(set(rendered.values())) == 1, rendered  # every process the same
    rules, mig_resources, vgpu_modes = next(iter(rendered.values()))
    assert (mig_resources, vgpu_modes) == ("1", "hami-core,mig")
    monkeypatch.setenv("TESSERA_CARD_MODE_DEFAULTS", rules)
    assert env_card_mode_defaults("TESSERA_CARD_MODE_DEFAULTS") == (
        {"model": "A100", "mode": "mig"},
        {"model": "NVIDIA L4", "mode": "mps"},
    )


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ("cardModes.defaults[0].mode=vgpu", "/cardModes/defaults/0/mode"),
        ("cardModes.defaults[0].model=A100", "/cardModes/defaults/0"),  # no mode
        (
            "cardModes.defaults[0].model=  ,cardModes.defaults[0].mode=mig",
            "/cardModes/defaults/0/model",
        ),
        ("cardModes.migResources=maybe", "/cardModes/migResources"),
        ("cardModes.defaultVgpuModes=cuda", "/cardModes/defaultVgpuModes"),
        ("cardModes.default=x", "cardModes"),
    ],
)
def test_values_schema_refuses_bad_card_modes(tmp_path: Path, bad: str, field: str) -> None:
    proc = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION,
                    "--set", bad, home=tmp_path, check=False)  # fmt: skip
    assert proc.returncode != 0, bad
    assert field in proc.stderr, proc.stderr


def _nodeplugin(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [plugin] = [
        c
        for d in docs
        if d["kind"] == "DaemonSet"
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] == "nodeplugin"
    ]
    return dict(plugin)


def test_the_node_plugin_gets_what_mps_and_mig_cards_need_only_when_asked(tmp_path: Path) -> None:
    plain = _nodeplugin(render())
    env = {e["name"]: e.get("value") for e in plain["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "NVIDIA_MIG_CONFIG_DEVICES" not in env
    assert plain["securityContext"]["allowPrivilegeEscalation"] is False
    assert "privileged" not in plain["securityContext"]

    values = tmp_path / "modes.yaml"
    values.write_text("cardModes:\n  mps: true\n  mig: true\n")
    both = _nodeplugin(render(str(values)))
    env = {e["name"]: e.get("value") for e in both["env"]}
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility,compute"
    assert env["NVIDIA_MIG_CONFIG_DEVICES"] == env["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
    assert both["securityContext"]["privileged"] is True
