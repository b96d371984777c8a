"""The chart's `mode: extender | dra` (docs/dra.md): the DeviceClasses DRA mode renders, and the
values the chart cannot serve, refused with the reason."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from nodeplugin.allocation import MODES
from nodeplugin.dra_slices import DRIVER
from tests.deploy.chart import CHART, KUBE_VERSION, RELEASE, render, run_helm

pytestmark = pytest.mark.usefixtures("helm")


def classes(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "DeviceClass"}


def selected_modes(device_class: dict[str, Any]) -> set[str]:
    """The card modes a class's CEL selector accepts, for this driver only."""
    (selector,) = device_class["spec"]["selectors"]
    expression = selector["cel"]["expression"]
    assert f'device.driver == "{DRIVER}"' in expression
    mode_in = rf'device\.attributes\["{re.escape(DRIVER)}"\]\.mode in (\[.*?\])'
    match = re.search(mode_in, expression)
    assert match, expression
    return set(json.loads(match.group(1)))


def test_extender_mode_renders_no_device_class() -> None:
    assert classes(render()) == {}


def test_dra_mode_renders_a_class_per_accepted_mode_set() -> None:
    found = classes(render(sets=("mode=dra",)))
    assert {n: selected_modes(c) for n, c in found.items()} == {
        DRIVER: {"shared", "exclusive"},  # hami-core
        f"mps.{DRIVER}": {"mps"},
        f"mig.{DRIVER}": {"mig"},
    }
    # Every card mode the node plugin publishes is reachable through exactly one class.
    modes = [m for c in found.values() for m in selected_modes(c)]
    assert sorted(modes) == sorted(MODES)
    for c in found.values():
        assert c["apiVersion"] == "resource.k8s.io/v1"
        assert "extendedResourceName" not in c["spec"]


def test_extended_resource_name_goes_on_the_hami_core_class_only() -> None:
    found = classes(render(sets=("mode=dra", "dra.extendedResourceName=tessera.io/gpu")))
    assert found[DRIVER]["spec"]["extendedResourceName"] == "tessera.io/gpu"
    assert all("extendedResourceName" not in c["spec"] for n, c in found.items() if n != DRIVER)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["mode=both"],
            "mode=both is not a mode Tessera runs: use mode=extender (the scheduler extender and "
            "the device plugin) or mode=dra",
        ),
        (["mode=DRA"], "mode=DRA is not a mode Tessera runs"),
        (
            ["mode=dra", "cardModes.migResources=true"],
            "mode=dra cannot serve cardModes.migResources=true",
        ),
        (["dra.extendedResourceName=not a name"], "/dra/extendedResourceName"),
    ],
    ids=["unknown-mode", "wrong-case", "dra-with-mig-resources", "bad-extended-resource"],
)
def test_chart_refuses_what_it_cannot_serve(sets: list[str], message: str, tmp_path: Path) -> None:
    args = ["template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION]
    for item in sets:
        args += ["--set", item]
    proc = run_helm(*args, home=tmp_path, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_mig_resources_stay_allowed_in_extender_mode() -> None:
    assert render(sets=("cardModes.migResources=true",))
