"""Pure pieces of the card modes: nvidia-caps minors, MPS limits, the modes answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nodeplugin import edits
from nodeplugin.allocation import ContainerAllocation, SliceDevice
from nodeplugin.cards import modes_from_answer
from nodeplugin.mig import MigError, cap_minors
from tests.nodeplugin.harness.gpu import FakeCard, GpuNode
from tests.nodeplugin.harness.plugin import REPO
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


# ---- the fake NVML's MIG model, through real pynvml and nodeplugin.mig -----------------------

GEOMETRY_SCRIPT = """
import ctypes, json, pynvml
from nodeplugin.allocation import MigPlacement
from nodeplugin.mig import Mig, MigError
from nodeplugin.nvml import Nvml
from pathlib import Path
n = Nvml()
(card,) = [c.uuid for c in n.discover()]
h = n.handles[card]
m = Mig(n.handles, Path(STATE_DIR))
out = {"before": list(pynvml.nvmlDeviceGetMigMode(h)), "enable": m.enable(card).__dict__}
placements = {}
for name, prof in m._profile_table(card).items():
    arr = (pynvml.c_nvmlGpuInstancePlacement_t * 8)()
    count = ctypes.c_uint(8)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(h, prof.id, arr, ctypes.byref(count))
    placements[name] = [(arr[i].start, arr[i].size) for i in range(count.value)]
out["placements"] = placements
def attempt(profile, start, size):
    try:
        return m.ensure(card, MigPlacement(profile, start, size))[0].uuid[:4]
    except MigError as exc:
        return str(exc)
out["steps"] = [
    attempt("4g.40gb", 0, 4),
    attempt("3g.40gb", 4, 4),
    attempt("1g.10gb", 6, 1),
    attempt("2g.20gb", 1, 2),
]
gi = m.instances(card)[0].gi
gih = pynvml.nvmlDeviceGetGpuInstanceById(h, gi)
try:
    pynvml.nvmlGpuInstanceDestroy(gih)
except pynvml.NVMLError as exc:
    out["destroy_with_ci"] = str(exc)
out["disable_with_instances"] = pynvml.nvmlDeviceSetMigMode(h, 0)
for i in m.instances(card):
    m.destroy(card, i.gi)
out["after"] = m.instances(card)
print(json.dumps(out))
"""


def test_the_fake_nvml_models_one_a100_geometry(tmp_path: Path) -> None:
    """What the MIG tests stand on: NVIDIA's A100/H100 80GB placements, slices that never
    overlap, the compute slices' limit, and the driver's refusals."""
    gpu = GpuNode(tmp_path, [FakeCard("GPU-aaaa0000-0000-0000-0000-000000000000", mig=True)])
    proc = subprocess.run(
        [sys.executable, "-c", GEOMETRY_SCRIPT.replace("STATE_DIR", repr(str(tmp_path / "state")))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **gpu.env(), "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["before"] == [0, 0]
    assert out["enable"] == {"capable": True, "enabled": True, "pending": False}
    assert out["placements"] == {
        "1g.10gb": [[s, 1] for s in range(7)],
        "1g.10gb+me": [[s, 1] for s in range(7)],
        "1g.20gb": [[0, 2], [2, 2], [4, 2], [6, 2]],
        "2g.20gb": [[0, 2], [2, 2], [4, 2]],
        "3g.40gb": [[0, 4], [4, 4]],
        "4g.40gb": [[0, 4]],
        "7g.80gb": [[0, 8]],
    }
    four, three, one, two = out["steps"]
    assert four == three == "MIG-"  # 4 + 3 compute slices: the card's 7
    assert "1g.10gb at placement start=6 size=1" in one and "Insufficient resources" in one
    assert "2g.20gb at placement start=1 size=2" in two and "Invalid Argument" in two
    assert "in use" in out["destroy_with_ci"]  # compute instances still on it
    assert out["disable_with_instances"] == 19  # NVML_ERROR_IN_USE as the activation status
    assert out["after"] == []
