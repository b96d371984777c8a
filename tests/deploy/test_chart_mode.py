"""The e2e harness's reading of the rendered chart (e2e/chart.py, chart mode; docs/e2e.md).

Every values set must give the harness a configuration it can run (the chart's parts agreeing
on names, every Secret or field reference accounted for); a chart whose parts disagree, or that
sets something the harness cannot honour, must stop chart mode with the reason.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from controlplane.scheduling import ResourceNames
from e2e.chart import OVERRIDDEN, ChartConfig, ChartError
from tests.deploy.chart import EXTENDER_VALUES_FILES, container, render

ALL_SETS = [(), *[(name,) for name in EXTENDER_VALUES_FILES]]
pytestmark = pytest.mark.usefixtures("helm")


def _read(docs: list[dict[str, Any]]) -> ChartConfig:
    return ChartConfig.from_manifests(docs, source="test")


@pytest.mark.parametrize("values", ALL_SETS, ids=lambda v: v[0] if v else "defaults")
def test_every_values_set_gives_the_harness_a_configuration(values: tuple[str, ...]) -> None:
    docs = render(*values)
    config = _read(docs)
    assert not set(config.env) & set(OVERRIDDEN)
    assert config.env["TESSERA_ENV"] == "production"
    assert config.env["TESSERA_SERVE_EXTENDER"] == "1"  # from the scheduler's sidecar
    assert {"Deployment tessera-controlplane/app", "Deployment tessera-scheduler/extender"} <= set(
        config.containers
    )
    # Every plain setting of the app container reaches the harness, unless overridden.
    app = container(docs, "controlplane", "app")
    for item in app["env"]:
        if item["name"] not in OVERRIDDEN:
            assert config.env[item["name"]] == item["value"]
    extender, profiles = config.scheduler_parts()
    assert [p["schedulerName"] for p in profiles] == [config.scheduler_name]
    assert {m["name"] for m in extender["managedResources"]} == set(config.resources.all())


def test_renamed_resources_reach_every_part() -> None:
    config = _read(render("values-resources.yaml"))
    assert config.resources == ResourceNames(
        gpu="tessera.io/gpu",
        gpumem="tessera.io/gpumem",
        gpumem_percentage="tessera.io/gpumem-percentage",
        gpucores="tessera.io/gpucores",
        priority="tessera.io/priority",
    )
    assert config.node_resource == "tessera.io/gpu"
    assert config.scheduler_name == "tessera-slices"
    assert _read(render()).resources == ResourceNames()


def _scheduler_configmap(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [configmap] = [d for d in docs if d["kind"] == "ConfigMap" and "scheduler-config.yaml" in (
        d.get("data") or {})]  # fmt: skip
    return configmap


def test_a_scheduler_managing_other_names_than_the_control_plane_is_refused() -> None:
    docs = render("values-resources.yaml")
    configmap = _scheduler_configmap(docs)
    inner = yaml.safe_load(configmap["data"]["scheduler-config.yaml"])
    inner["extenders"][0]["managedResources"][0]["name"] = "nvidia.com/gpu"
    configmap["data"]["scheduler-config.yaml"] = yaml.safe_dump(inner)
    with pytest.raises(ChartError, match="managedResources"):
        _read(docs)


def test_a_profile_not_named_like_the_webhooks_scheduler_is_refused() -> None:
    docs = render()
    configmap = _scheduler_configmap(docs)
    inner = yaml.safe_load(configmap["data"]["scheduler-config.yaml"])
    inner["profiles"][0]["schedulerName"] = "someone-else"
    configmap["data"]["scheduler-config.yaml"] = yaml.safe_dump(inner)
    with pytest.raises(ChartError, match="'tessera-scheduler'"):
        _read(docs)


def test_a_node_plugin_advertising_another_name_is_refused() -> None:
    docs = render()
    [daemonset] = [d for d in docs if d["kind"] == "DaemonSet"]
    for item in daemonset["spec"]["template"]["spec"]["containers"][0]["env"]:
        if item["name"] == "TESSERA_RESOURCE_GPU":
            item["value"] = "example.com/gpu"
    with pytest.raises(ChartError, match=r"node plugin advertises 'example\.com/gpu'"):
        _read(docs)


def test_containers_that_disagree_on_a_setting_are_refused() -> None:
    docs = render()
    container(docs, "worker", "worker")["env"].append(
        {"name": "TESSERA_DEFAULT_SLOTS", "value": "4"}
    )
    container(docs, "controlplane", "app")["env"].append(
        {"name": "TESSERA_DEFAULT_SLOTS", "value": "8"}
    )
    with pytest.raises(ChartError, match=r"TESSERA_DEFAULT_SLOTS is '8'.* but '4'"):
        _read(docs)


def test_a_secret_reference_the_harness_does_not_know_is_refused() -> None:
    docs = render()
    ref = {"secretKeyRef": {"name": "vault", "key": "token"}}
    container(docs, "controlplane", "app")["env"].append(
        {"name": "TESSERA_SOMETHING", "valueFrom": ref}
    )
    with pytest.raises(ChartError, match=r"env TESSERA_SOMETHING comes from .*OVERRIDDEN"):
        _read(docs)


def test_references_are_expanded_like_the_kubelet_does() -> None:
    docs = render()
    env = container(docs, "controlplane", "app")["env"]
    env += [
        {"name": "TESSERA_LOG_LEVEL", "value": "debug"},
        {"name": "TESSERA_E2E_ECHO", "value": "$(TESSERA_LOG_LEVEL)/$(UNSET)"},
    ]
    assert _read(docs).env["TESSERA_E2E_ECHO"] == "debug/$(UNSET)"
