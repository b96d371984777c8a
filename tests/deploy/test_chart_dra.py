"""The chart's `mode: extender | dra` (docs/dra.md): the DeviceClasses DRA mode renders, and the
values the chart cannot serve, refused with the reason."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from nodeplugin import config
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
        (
            ["mode=dra", "nodeplugin.deviceMode=paths"],
            "mode=dra cannot serve nodeplugin.deviceMode=paths",
        ),
        (
            ["mode=dra", "nodeplugin.allocationSource=annotation"],
            "mode=dra cannot serve nodeplugin.allocationSource=annotation",
        ),
    ],
    ids=[
        "unknown-mode",
        "wrong-case",
        "dra-with-mig-resources",
        "bad-extended-resource",
        "dra-without-cdi",
        "dra-with-annotations",
    ],
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


def daemonset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds


def kinds_and_names(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in docs}


def test_dra_mode_leaves_the_extender_and_the_webhook_out() -> None:
    extender, dra = kinds_and_names(render()), kinds_and_names(render(sets=("mode=dra",)))
    gone = {
        ("MutatingWebhookConfiguration", RELEASE),
        ("Deployment", f"{RELEASE}-scheduler"),
        ("NetworkPolicy", f"{RELEASE}-scheduler"),
        ("ServiceAccount", f"{RELEASE}-scheduler"),
    }
    assert gone <= extender
    assert not gone & dra
    # The node plugins trust the control plane's HTTPS through this Secret in both modes.
    assert ("Secret", f"{RELEASE}-webhook-tls") in dra


def test_dra_mode_runs_the_node_plugin_as_a_kubelet_dra_plugin() -> None:
    docs = render(sets=("mode=dra",))
    pod = daemonset(docs)["spec"]["template"]["spec"]
    (plugin,) = pod["containers"]
    env = {e["name"]: e["value"] for e in plugin["env"] if "value" in e}
    # The plugin reads the rendered settings as the chart means them (in a cluster). It reads
    # no pod's allocation, so it needs no allocation key.
    assert env["TESSERA_ALLOCATION_FALLBACK"] == "false"
    assert "TESSERA_ALLOCATION_KEY_FILE" not in env
    in_cluster = {"TESSERA_NODE_NAME": "n1", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    settings = config.load({**env, **in_cluster})
    assert settings.plugin_mode == config.DRA
    mounts = {m["name"]: m["mountPath"] for m in plugin["volumeMounts"]}
    host = {v["name"]: v.get("hostPath", {}).get("path") for v in pod["volumes"]}
    # Same paths inside and outside: the kubelet dials the endpoint the plugin names.
    assert mounts["plugins-registry"] == host["plugins-registry"] == str(settings.dra_registry_dir)
    assert mounts["dra-plugin"] == host["dra-plugin"] == str(settings.dra_plugin_dir)
    assert settings.dra_registry_dir == Path("/var/lib/kubelet/plugins_registry")
    assert settings.dra_plugin_dir == Path(f"/var/lib/kubelet/plugins/{DRIVER}")
    assert pod["automountServiceAccountToken"] is True
    assert f"{DRIVER}-reg.sock" in " ".join(plugin["livenessProbe"]["exec"]["command"])
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and "nodeplugin" in d["metadata"]["name"]
    ]
    assert role["rules"] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices"],
            "verbs": ["get", "list", "create", "update", "delete"],
        },
    ]
    policies = [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]
    assert {d["kind"] for d in policies} == {
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }


def test_extender_mode_keeps_the_device_plugin_as_it_was() -> None:
    docs = render()
    (plugin,) = daemonset(docs)["spec"]["template"]["spec"]["containers"]
    names = {e["name"] for e in plugin["env"]}
    assert not names & {"TESSERA_PLUGIN_MODE", "TESSERA_DRA_REGISTRY_DIR", "TESSERA_DRA_PLUGIN_DIR"}
    assert not [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]
