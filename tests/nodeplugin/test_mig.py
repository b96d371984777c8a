"""Pure pieces of the card modes: nvidia-caps minors, MPS limits, the modes answer."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeplugin import edits
from nodeplugin.allocation import ContainerAllocation, SliceDevice
from nodeplugin.cards import modes_from_answer
from nodeplugin.mig import MigError, cap_minors
from tests.nodeplugin.test_edits import CARDS, LAYOUT


def test_cap_minors_from_the_drivers_table(tmp_path: Path) -> None:
    table = tmp_path / "driver" / "nvidia-caps" / "mig-minors"
    table.parent.mkdir(parents=True)
    table.write_text(
        "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n"
        "gpu3/gi1/access 120\ngpu3/gi1/ci0/access 121\ngpu3/gi2/ci0/access 130\n"
    )
    assert cap_minors(tmp_path, 3, 1, 0) == (120, 121)
    assert cap_minors(tmp_path, 0, 1, 0) == (12, 13)


def test_cap_minors_from_the_access_files_without_the_table(tmp_path: Path) -> None:
    base = tmp_path / "driver" / "nvidia" / "capabilities" / "gpu2" / "mig" / "gi5"
    (base / "ci1").mkdir(parents=True)
    (base / "access").write_text("DeviceFileMinor: 48\nDeviceFileMode: 292\n")
    (base / "ci1" / "access").write_text("DeviceFileMinor: 50\nDeviceFileMode: 292\n")
    assert cap_minors(tmp_path, 2, 5, 1) == (48, 50)
    with pytest.raises(MigError, match=r"no device minor for MIG capability gpu2/gi5/ci2/access"):
        cap_minors(tmp_path, 2, 5, 2)


def test_mps_and_exclusive_slices_get_no_shim_limits_and_mps_gets_its_own() -> None:
    c = ContainerAllocation(
        "app",
        0,
        False,
        (
            SliceDevice("GPU-a", 2000, 10),
            SliceDevice("GPU-b", 8192, 40, "mps"),
            SliceDevice("GPU-c", 4096, 25, "mps"),
        ),
    )
    p = edits.make_plan("alloc-m", c, CARDS)
    env = edits.container_env(p, LAYOUT)
    assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "2000"
    assert not [k for k in env if k.endswith(("_LIMIT_1", "_LIMIT_2"))]
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=8192M,2=4096M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"  # within both mps slices
    ex = ContainerAllocation("app", 0, False, (SliceDevice("GPU-a", 81920, 100, "exclusive"),))
    env = edits.container_env(edits.make_plan("alloc-e", ex, CARDS), LAYOUT)
    assert not [k for k in env if k.startswith(("TESSERA_DEVICE_", "CUDA_MPS_"))]
    mounts = edits.cdi_spec("k/g", edits.make_plan("alloc-e", ex, CARDS), LAYOUT, [])
    assert LAYOUT.mps_container_dir not in str(mounts), "no MPS pipe without mps slices"


def test_modes_answer_is_read_for_this_nodes_cards_only() -> None:
    uuids = {"GPU-a", "GPU-b"}
    assert modes_from_answer({"node": "n"}, uuids) is None  # an older control plane
    assert modes_from_answer({"modes": "mig"}, uuids) is None
    got = modes_from_answer({"modes": {"GPU-a": "mig", "GPU-b": "vgpu", "GPU-z": "mps"}}, uuids)
    assert got == {"GPU-a": "mig"}
