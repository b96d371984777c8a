from __future__ import annotations

from pathlib import Path

import pytest

from nodeplugin import edits
from nodeplugin.allocation import ContainerAllocation, SliceDevice
from nodeplugin.cards import (
    VIRTUAL_MEMORY_KEYS,
    Card,
    Health,
    inventory_report,
    virtual_memory_fields,
)

CARDS = {
    "GPU-a": Card("GPU-a", 0, "A100", 81920, 0, 0),
    "GPU-b": Card("GPU-b", 1, "A100", 81920, 3, 1),
    "GPU-c": Card("GPU-c", 2, "A100", 81920, 5, None),
}
LAYOUT = edits.Layout(
    dev_root=Path("/dev"),
    region_dir=Path("/run/tessera/regions"),
    region_container_dir="/var/run/tessera",
    state_dir=Path("/var/lib/tessera"),
    config_container_dir="/etc/tessera",
    shim_library=Path("/opt/tessera/libtessera.so"),
    shim_container_path="/usr/local/tessera/lib/libtessera.so",
    preload=True,
)


def plan(priority: int | None = None) -> edits.ContainerPlan:
    c = ContainerAllocation(
        "app",
        0,
        False,
        (SliceDevice("GPU-b", 4000, 30), SliceDevice("GPU-a", 2000, 0)),
        priority,
    )
    return edits.make_plan("alloc-x", c, CARDS, namespace="ns", pod="p", pod_uid="u")


def test_env_follows_the_allocation_order() -> None:
    env = edits.container_env(plan(), LAYOUT)
    assert env == {
        "CUDA_VISIBLE_DEVICES": "GPU-b,GPU-a",
        "NVIDIA_VISIBLE_DEVICES": "GPU-b,GPU-a",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "TESSERA_DEVICE_MEMORY_LIMIT_0": "4000",
        "TESSERA_DEVICE_CORE_LIMIT_0": "30",
        "TESSERA_DEVICE_MEMORY_LIMIT_1": "2000",
        "TESSERA_DEVICE_CORE_LIMIT_1": "0",
        "TESSERA_SHARED_REGION": "/var/run/tessera/region",
        "TESSERA_ALLOCATION": "alloc-x",
    }


@pytest.mark.parametrize("priority", [0, 1])
def test_task_priority_goes_into_the_environment_when_the_pod_asked(priority: int) -> None:
    env = edits.container_env(plan(priority), LAYOUT)
    assert env["TESSERA_TASK_PRIORITY"] == str(priority)
    assert {k: v for k, v in env.items() if k != "TESSERA_TASK_PRIORITY"} == edits.container_env(
        plan(), LAYOUT
    )
    spec = edits.cdi_spec("tessera.io/gpu", plan(priority), LAYOUT, [])
    (dev,) = spec["devices"]  # type: ignore[misc]
    assert f"TESSERA_TASK_PRIORITY={priority}" in dev["containerEdits"]["env"]
    assert f"TESSERA_TASK_PRIORITY={priority}\n" in edits.paths_config(plan(priority), LAYOUT)


def test_no_task_priority_without_the_pod_asking() -> None:
    spec = edits.cdi_spec("tessera.io/gpu", plan(), LAYOUT, [])
    (dev,) = spec["devices"]  # type: ignore[misc]
    assert not any(e.startswith("TESSERA_TASK_PRIORITY") for e in dev["containerEdits"]["env"])
    assert "TESSERA_TASK_PRIORITY" not in edits.paths_config(plan(), LAYOUT)


def oversubscribed_plan() -> edits.ContainerPlan:
    c = ContainerAllocation(
        "app",
        0,
        False,
        (
            SliceDevice("GPU-b", 4000, 30, resident_mib=2667),
            SliceDevice("GPU-a", 2000, 0),
            SliceDevice("GPU-c", 1000, 0, resident_mib=1000),
        ),
    )
    return edits.make_plan("alloc-y", c, CARDS, namespace="ns", pod="p", pod_uid="u")


def test_a_resident_part_goes_beside_the_limit_only_where_the_record_has_one() -> None:
    env = edits.container_env(oversubscribed_plan(), LAYOUT)
    resident = {k: v for k, v in env.items() if k.startswith("TESSERA_DEVICE_MEMORY_RESIDENT_")}
    assert resident == {
        "TESSERA_DEVICE_MEMORY_RESIDENT_0": "2667",
        "TESSERA_DEVICE_MEMORY_RESIDENT_2": "1000",
    }
    assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "4000"
    spec = edits.cdi_spec("tessera.io/gpu", oversubscribed_plan(), LAYOUT, [])
    (dev,) = spec["devices"]  # type: ignore[misc]
    assert "TESSERA_DEVICE_MEMORY_RESIDENT_0=2667" in dev["containerEdits"]["env"]
    # host-path mode numbers the cards by index: GPU-a 0, GPU-b 1, GPU-c 2
    config = edits.paths_config(oversubscribed_plan(), LAYOUT)
    assert "TESSERA_DEVICE_MEMORY_RESIDENT_1=2667\n" in config
    assert "TESSERA_DEVICE_MEMORY_RESIDENT_0" not in config


def test_no_resident_part_no_variable() -> None:
    env = edits.container_env(plan(), LAYOUT)
    assert not any(k.startswith("TESSERA_DEVICE_MEMORY_RESIDENT_") for k in env)


def test_cdi_spec_gives_exactly_the_cards() -> None:
    spec = edits.cdi_spec("tessera.io/gpu", plan(), LAYOUT, ["nvidiactl", "nvidia-uvm"])
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "tessera.io/gpu"
    (dev,) = spec["devices"]  # type: ignore[misc]
    assert dev["name"] == "alloc-x"
    edits_ = dev["containerEdits"]
    assert [n["path"] for n in edits_["deviceNodes"]] == [
        "/dev/nvidia3",
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-uvm",
    ]
    assert {m["containerPath"]: m["hostPath"] for m in edits_["mounts"]} == {
        "/usr/local/tessera/lib/libtessera.so": "/opt/tessera/libtessera.so",
        "/etc/ld.so.preload": "/var/lib/tessera/ld.so.preload",
        "/var/run/tessera": "/run/tessera/regions/alloc-x",
    }
    assert "TESSERA_DEVICE_MEMORY_LIMIT_0=4000" in edits_["env"]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in edits_["env"]
    assert set(edits_) == {"env", "deviceNodes", "mounts"}  # nothing CDI would reject
    assert edits.cdi_file_name("tessera.io/gpu", "alloc-x") == "tessera.io_gpu-alloc-x.json"


def test_unknown_card_in_the_record_is_refused() -> None:
    c = ContainerAllocation("app", 0, False, (SliceDevice("GPU-zz", 1, 0),))
    with pytest.raises(edits.PlanError, match="GPU-zz"):
        edits.make_plan("n", c, CARDS)


def test_paths_mode_orders_by_index_and_permutes_limits() -> None:
    r = edits.paths_allocate("alloc-x", [CARDS["GPU-b"], CARDS["GPU-a"]], LAYOUT, ["nvidiactl"])
    assert r.devices[:2] == [
        ("/dev/nvidia0", "/var/lib/tessera/paths/alloc-x/dev/nvidia0", "rw"),
        ("/dev/nvidia3", "/var/lib/tessera/paths/alloc-x/dev/nvidia3", "rw"),
    ]
    assert r.envs["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert r.envs["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert ("/etc/tessera", "/var/lib/tessera/paths/alloc-x/config", True) in r.mounts
    config = edits.paths_config(plan(), LAYOUT)
    assert "TESSERA_DEVICE_MEMORY_LIMIT_0=2000\n" in config  # GPU-a is ordinal 0 here
    assert "TESSERA_DEVICE_MEMORY_LIMIT_1=4000\n" in config
    assert "TESSERA_DEVICE_CORE_LIMIT_1=30\n" in config


def test_inventory_report_is_exactly_the_design_shape() -> None:
    body = inventory_report("1.0", list(CARDS.values()), {"GPU-b": Health(False, "XID 79")})
    assert set(body) == {"plugin_version", "cards"}
    cards = body["cards"]
    assert isinstance(cards, list)
    assert cards[1] == {
        "uuid": "GPU-b",
        "index": 1,
        "model": "A100",
        "memory_mib": 81920,
        "numa_node": 1,
        "healthy": False,
        "health_reason": "XID 79",
    }
    assert cards[2]["numa_node"] is None


@pytest.mark.parametrize("order", [["GPU-a", "GPU-b"], ["GPU-b", "GPU-a"], ["GPU-c"]])
def test_every_gpu_container_numbers_cards_in_pci_order(order: list[str]) -> None:
    """Both ways a container gets its environment ask CUDA for PCI order, the order NVML (and
    the shim's NVML hooks) number cards in, whatever order the allocation lists them in."""
    c = ContainerAllocation("app", 0, False, tuple(SliceDevice(u, 1000, 0) for u in order))
    plan_ = edits.make_plan("alloc-y", c, CARDS)
    assert edits.container_env(plan_, LAYOUT)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    paths = edits.paths_allocate("alloc-y", [CARDS[u] for u in order], LAYOUT, [])
    assert paths.envs["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_a_node_that_oversubscribes_says_so_at_the_top_of_its_report() -> None:
    memory = virtual_memory_fields("1.5", 16384, 65536)
    body = inventory_report("1.0", list(CARDS.values()), {}, memory=memory)
    assert set(body) == {"plugin_version", "cards", *VIRTUAL_MEMORY_KEYS}
    assert (body["memory_oversubscription"], body["spill_reserve_mib"]) == ("1.5", 16384)
    assert body["host_memory_mib"] == 65536
    # a reserve alone is enough to say it; an unknown node memory is left out
    assert virtual_memory_fields("1", 1024, None) == {
        "memory_oversubscription": "1",
        "spill_reserve_mib": 1024,
    }


def test_a_node_that_leaves_oversubscription_off_reports_as_before() -> None:
    assert virtual_memory_fields("1", 0, 65536) == {}
    body = inventory_report(
        "1.0", list(CARDS.values()), {}, memory=virtual_memory_fields("1", 0, 1)
    )
    assert set(body) == {"plugin_version", "cards"}
