"""The benchmark's HAMi set-up (e2e/hami.py, e2e/hami_plugin.py): what it reads from HAMi's chart,
what it writes on the nodes, and when its device-plugin stand-in takes a node lock off.

The manifests here are shaped like HAMi's rendered chart (`helm template`, plain-HTTP variant),
cut to the parts the harness reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from e2e.hami import HamiChart, allocated_devices, register_annotation, registered_cards
from e2e.hami_plugin import NODE_LOCK, lock_held_by, release_patch, waiting_for_allocation
from e2e.harness import HarnessError
from e2e.objects import inventory

SCHEDULER_CONFIG = """
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: true
profiles:
- schedulerName: hami-scheduler
extenders:
- urlPrefix: "http://127.0.0.1:80"
  enableHTTPS: false
  filterVerb: filter
  bindVerb: bind
  nodeCacheCapable: true
  weight: 1
  httpTimeout: 30s
  managedResources:
  - {name: nvidia.com/gpu, ignoredByScheduler: true}
"""
DEVICE_CONFIG = """
nvidia:
  resourceCountName: nvidia.com/gpu
  deviceSplitCount: 4
  deviceMemoryScaling: 1.5
  deviceCoreScaling: 2
"""


def manifests() -> list[dict[str, Any]]:
    return [
        {"kind": "ConfigMap", "data": {"config.yaml": SCHEDULER_CONFIG}},
        {"kind": "ConfigMap", "data": {"device-config.yaml": DEVICE_CONFIG}},
        {
            "kind": "Deployment",
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {"name": "kube-scheduler", "command": ["kube-scheduler"]},
                            {
                                "name": "vgpu-scheduler-extender",
                                "env": [
                                    {"name": "HAMI_NODELOCK_EXPIRE", "value": "5m"},
                                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {}}},
                                ],
                                "command": [
                                    "scheduler",
                                    "--http_bind=0.0.0.0:80",
                                    "--scheduler-name=hami-scheduler",
                                    "--metrics-bind-address=:9395",
                                    "--node-scheduler-policy=binpack",
                                    "--device-config-file=/device-config.yaml",
                                    "--leader-elect=true",
                                    "--leader-elect-resource-name=hami-scheduler",
                                    "--debug",
                                    "-v=4",
                                ],
                            },
                        ]
                    }
                }
            },
        },
    ]


def test_hamis_kube_scheduler_runs_the_charts_configuration_at_the_runs_url() -> None:
    chart = HamiChart.from_manifests(manifests(), "test chart")
    client = {"qps": 1000, "burst": 2000}
    config = chart.scheduler_config("http://127.0.0.1:4242", Path("/run/s.kubeconfig"), client)
    assert chart.scheduler_name == "hami-scheduler"
    assert [p["schedulerName"] for p in config["profiles"]] == ["hami-scheduler"]
    assert [e["urlPrefix"] for e in config["extenders"]] == ["http://127.0.0.1:4242"]
    entry = config["extenders"][0]
    assert (entry["filterVerb"], entry["bindVerb"], entry["nodeCacheCapable"]) == (
        "filter",
        "bind",
        True,
    )
    assert "prioritizeVerb" not in entry  # nothing the chart does not say
    assert config["clientConnection"] == {**client, "kubeconfig": "/run/s.kubeconfig"}
    assert config["leaderElection"] == {"leaderElect": False}  # the chart's says true
    assert chart.scheduler["extenders"][0]["urlPrefix"] == "http://127.0.0.1:80"  # a copy
    assert chart.env == {"HAMI_NODELOCK_EXPIRE": "5m"}  # plain values only


def test_the_command_line_keeps_the_charts_policy_and_replaces_what_the_harness_owns() -> None:
    chart = HamiChart.from_manifests(manifests(), "test chart")
    device_config = Path("/run/device-config.yaml")
    argv = chart.command_line("127.0.0.1:1", "127.0.0.1:2", device_config, (1000, 2000))
    assert "--node-scheduler-policy=binpack" in argv
    assert "--scheduler-name=hami-scheduler" in argv
    assert "--http_bind=127.0.0.1:1" in argv and "--http_bind=0.0.0.0:80" not in argv
    assert "--metrics-bind-address=127.0.0.1:2" in argv
    assert "--device-config-file=/run/device-config.yaml" in argv
    assert "--leader-elect=false" in argv and "--leader-elect=true" not in argv
    assert not any(a.startswith("--leader-elect-resource") for a in argv)
    assert "--debug" not in argv and "-v=4" not in argv
    assert "--kube-qps=1000" in argv and "--kube-burst=2000" in argv
    flags = [a.split("=", 1)[0] for a in argv]
    assert len(flags) == len(set(flags)), argv  # every flag once
    shipped = chart.command_line("127.0.0.1:1", "127.0.0.1:2", device_config, None)
    assert not any(a.startswith(("--kube-qps", "--kube-burst")) for a in shipped)


@pytest.mark.parametrize("missing", [0, 1, 2])
def test_a_chart_without_one_of_its_parts_is_refused(missing: int) -> None:
    docs = manifests()
    del docs[missing]
    with pytest.raises(HarnessError, match="test chart: no "):
        HamiChart.from_manifests(docs, "test chart")


def test_nodes_register_their_cards_as_hamis_device_plugin_does() -> None:
    chart = HamiChart.from_manifests(manifests(), "test chart")
    cards = inventory("kwok-gpu-0007", cards=2)["cards"]
    devices = json.loads(register_annotation(cards, chart.device_settings()))
    assert [d["id"] for d in devices] == ["GPU-kwok-gpu-0007-0", "GPU-kwok-gpu-0007-1"]
    assert [d["index"] for d in devices] == [0, 1]
    first = devices[0]
    assert first["count"] == 4  # deviceSplitCount
    assert first["devmem"] == int(81920 * 1.5)  # deviceMemoryScaling
    assert first["devcore"] == 200  # deviceCoreScaling x 100
    assert first["type"] == "NVIDIA A100-SXM4-80GB"
    assert (first["mode"], first["health"]) == ("hami-core", True)
    other = json.loads(register_annotation([{**cards[0], "model": "Tesla T4"}], {}))
    assert other[0]["type"] == "NVIDIA-Tesla T4"  # the plugin prefixes a model without it
    assert other[0]["count"] == 10  # HAMi's default split


def test_registered_cards_counts_one_memory_limit_series_per_card() -> None:
    metrics = (
        "# HELP hami_gpu_memory_limit_bytes x\n"
        'hami_gpu_memory_limit_bytes{node="a",device_uuid="u0"} 1\n'
        'hami_gpu_memory_limit_bytes{node="a",device_uuid="u1"} 1\n'
        'hami_gpu_core_limit_ratio{node="a",device_uuid="u0"} 1\n'
    )
    assert registered_cards(metrics) == 2


def test_the_lock_is_released_only_by_the_pod_that_holds_it() -> None:
    lock = "2026-12-04T21:00:00Z,bench-d,b-00001"
    assert lock_held_by(lock, "bench-d", "b-00001")
    assert not lock_held_by(lock, "bench-d", "b-0000")
    assert not lock_held_by(lock, "other", "b-00001")
    assert lock_held_by("2026-12-04T21:00:00Z", "bench-d", "b-00001")  # the older, ownerless form
    node = {"metadata": {"resourceVersion": "77", "annotations": {NODE_LOCK: lock}}}
    assert release_patch(node, "bench-d", "b-00001") == {
        "metadata": {"annotations": {NODE_LOCK: None}, "resourceVersion": "77"}
    }
    assert release_patch(node, "bench-d", "b-00002") is None
    assert release_patch({"metadata": {"annotations": {}}}, "bench-d", "b-00001") is None


def test_only_a_bound_pod_in_the_allocating_phase_waits_for_the_plugin() -> None:
    def pod(node: str, phase: str | None) -> dict[str, Any]:
        annotations = {} if phase is None else {"hami.io/bind-phase": phase}
        return {"metadata": {"annotations": annotations}, "spec": {"nodeName": node}}

    assert waiting_for_allocation(pod("kwok-gpu-0001", "allocating"))
    assert not waiting_for_allocation(pod("", "allocating"))  # not bound yet
    assert not waiting_for_allocation(pod("kwok-gpu-0001", "success"))
    assert not waiting_for_allocation(pod("kwok-gpu-0001", None))


def test_hamis_allocation_annotation_reads_as_card_memory_and_cores() -> None:
    value = "GPU-a,NVIDIA-A100,1000,5:GPU-b,NVIDIA-A100,2000,10:;GPU-c,NVIDIA-A100,300,0:;"
    assert allocated_devices(value) == [("GPU-a", 1000, 5), ("GPU-b", 2000, 10), ("GPU-c", 300, 0)]
    assert allocated_devices("") == []
