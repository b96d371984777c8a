"""The chart's virtual device memory values reach the node plugin as the settings it reads
(docs/nodeplugin.md, "Virtual device memory"), in a form it takes, and bad ones stop the render
naming the value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nodeplugin import config
from tests.deploy.chart import CHART, KUBE_VERSION, RELEASE, render, run_helm

pytestmark = pytest.mark.usefixtures("helm")
KEYS = ("TESSERA_MEMORY_OVERSUBSCRIPTION", "TESSERA_SPILL_RESERVE_MIB")


def plugin_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    (ds,) = [
        d
        for d in docs
        if d["kind"] == "DaemonSet" and d["metadata"]["name"] == f"{RELEASE}-nodeplugin"
    ]
    (c,) = [c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "nodeplugin"]
    return {e["name"]: e.get("value") for e in c["env"] if e["name"] in KEYS}


def plugin_settings(env: dict[str, str], tmp_path: Path) -> config.Settings:
    """What the plugin makes of the rendered values on a node of 64 GiB."""
    (tmp_path / "meminfo").write_text("MemTotal:       67108864 kB\n")
    base = {"TESSERA_NODE_NAME": "n1", "TESSERA_CONTROLPLANE_URL": "https://cp:8443"}
    return config.load({**base, **env, "TESSERA_PROC_ROOT": str(tmp_path)})


def test_defaults_leave_oversubscription_off(tmp_path: Path) -> None:
    env = plugin_env(render())
    assert env == {"TESSERA_MEMORY_OVERSUBSCRIPTION": "1", "TESSERA_SPILL_RESERVE_MIB": "0"}
    s = plugin_settings(env, tmp_path)
    assert (s.memory_oversubscription, s.spill_reserve_mib) == ("1", 0)


@pytest.mark.parametrize(
    ("sets", "factor"),
    [
        (("nodeplugin.memoryOversubscription=1.5",), "1.5"),  # --set makes it a number
        (("nodeplugin.memoryOversubscription=2",), "2"),
        (("nodeplugin.memoryOversubscription=1.25",), "1.25"),
    ],
)
def test_the_factor_and_reserve_reach_the_plugin(
    sets: tuple[str, ...], factor: str, tmp_path: Path
) -> None:
    env = plugin_env(render(sets=(*sets, "nodeplugin.spillReserveMiB=16384")))
    assert env == {"TESSERA_MEMORY_OVERSUBSCRIPTION": factor, "TESSERA_SPILL_RESERVE_MIB": "16384"}
    s = plugin_settings(env, tmp_path)
    assert (s.memory_oversubscription, s.spill_reserve_mib) == (factor, 16384)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0.5", "nodeplugin.memoryOversubscription=0.5 is out of range"),
        ("17", "nodeplugin.memoryOversubscription=17 is out of range"),
        ("double", "nodeplugin.memoryOversubscription=double is not a decimal number"),
        ("1.255", "nodeplugin.memoryOversubscription=1.255 is not a decimal number"),
        ("-1", "nodeplugin.memoryOversubscription=-1 is not a decimal number"),
    ],
)
def test_a_bad_factor_stops_the_render_naming_it(value: str, message: str, tmp_path: Path) -> None:
    proc = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION,
                    "--set-string", f"nodeplugin.memoryOversubscription={value}",
                    home=tmp_path, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", ["-1", "lots"])
def test_the_schema_refuses_a_bad_reserve(value: str, tmp_path: Path) -> None:
    proc = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION,
                    "--set", f"nodeplugin.spillReserveMiB={value}", home=tmp_path,
                    check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "/nodeplugin/spillReserveMiB" in proc.stderr, proc.stderr
