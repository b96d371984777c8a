"""The proof kit (shim/gpucheck) without a GPU: its arithmetic, its header search, and the
whole kit run against the fake driver, so that the script a GPU machine runs cannot rot.

On the fake driver every check that needs only the CUDA driver API runs for real (the
shim preloaded into processes, the card looked at from outside through the fake NVML);
the PyTorch and CuPy checks must say SKIP with a reason.  A control run without the shim
must fail the memory and compute checks, or the kit could not tell a broken shim.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "shim"
KIT = SHIM / "gpucheck" / "kit.py"
MiB = 1 << 20


def load_kit() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tessera_gpu_kit", KIT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


kit = load_kit()


def run_kit(out: Path, *args: str) -> tuple[int, dict[str, Any]]:
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.fail("make and a C compiler are needed to build the shim and the fake driver")
    proc = subprocess.run(
        [sys.executable, str(KIT), "--fake", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    results = out / "results.json"
    assert results.is_file(), proc.stdout + proc.stderr
    return proc.returncode, json.loads(results.read_text())


def by_name(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in body["checks"]}


# ---- arithmetic and parsing -------------------------------------------------------------


def test_fill_bounds_allow_one_block_short_and_the_tolerance_over() -> None:
    lo, hi = kit.fill_bounds(4096, 64, 128)
    assert (lo, hi) == ((4096 - 64 - 128) * MiB, (4096 + 128) * MiB)
    assert kit.within(4076 * MiB, lo, hi)
    assert not kit.within(4225 * MiB, lo, hi)  # past the slice by more than the tolerance
    assert not kit.within(3000 * MiB, lo, hi)  # refused long before the slice


def test_median() -> None:
    assert kit.median([3.0, 1.0, 2.0]) == 2.0
    assert kit.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError):
        kit.median([])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096, 1324\n", (4096, 1324)), ("  4096 ,0 \n\n", (4096, 0))],
)
def test_nvidia_smi_csv(text: str, expected: tuple[int, int]) -> None:
    assert kit.parse_smi_csv(text) == expected


@pytest.mark.parametrize("text", ["", "4096\n", "4096, 12 MiB\n", "1, 2\n3, 4\n", "N/A, N/A\n"])
def test_nvidia_smi_csv_that_is_not_one_card_in_mib_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="nvidia-smi"):
        kit.parse_smi_csv(text)


def test_overhead_verdict_is_the_median_against_the_baseline() -> None:
    ok, slower = kit.overhead_verdict(
        {"no shim": [1.00, 1.02, 0.99], "shim": [1.005, 1.0, 1.009]}, "no shim", 0.01
    )
    assert ok and slower["shim"] == pytest.approx(0.005)
    ok, slower = kit.overhead_verdict(
        {"no shim": [1.0, 1.0, 1.0], "shim": [1.02, 1.0, 1.03]}, "no shim", 0.01
    )
    assert not ok and slower["shim"] == pytest.approx(0.02)


def test_table_has_a_row_per_result_in_aligned_columns() -> None:
    rows = [
        kit.Result("a", "PASS", "1 MiB", "<= 2 MiB"),
        kit.Result("longer name", "SKIP", reason="why"),
    ]
    lines = kit.format_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("check") and set(lines[1]) <= {"-", " "}
    assert lines[2].index("PASS") == lines[3].index("SKIP") == lines[0].index("status")
    assert lines[3].endswith("why")


# ---- finding the machine's CUDA headers ----------------------------------------------------


def test_header_search_order(tmp_path: Path) -> None:
    home, nvcc_root, site = tmp_path / "home", tmp_path / "toolkit", tmp_path / "site"
    nvcc = nvcc_root / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.touch()
    (site / "nvidia" / "cuda_runtime" / "include").mkdir(parents=True)
    dirs = kit.header_candidates({"CUDA_HOME": str(home)}, [str(site)], str(nvcc))
    assert dirs[0] == home / "include"
    assert dirs.index(nvcc_root / "include") < dirs.index(Path("/usr/local/cuda/include"))
    assert dirs[-1] == site / "nvidia" / "cuda_runtime" / "include"
    assert len(dirs) == len(set(dirs))


def test_headers_may_come_from_two_places(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    (b / "cuda.h").write_text("/* wheel */")
    (c / "cuda.h").write_text("/* later */")
    (c / "nvml.h").write_text("/* toolkit */")
    assert kit.find_headers([a, b, c]) == (b / "cuda.h", c / "nvml.h")


def test_missing_headers_are_named_with_the_places_searched(tmp_path: Path) -> None:
    (tmp_path / "cuda.h").write_text("")
    with pytest.raises(FileNotFoundError, match=r"nvml\.h not found; looked in .*CUDA_HOME"):
        kit.find_headers([tmp_path])


def test_the_shim_builds_with_headers_from_elsewhere_without_fetching(tmp_path: Path) -> None:
    """What the kit does on a GPU machine without the wheels: make with INC pointing at the
    machine's headers builds the library and never reaches for PyPI."""
    subprocess.run(["make", "-s", "-C", str(SHIM), "headers"], check=True, timeout=300)
    inc, build = tmp_path / "include", tmp_path / "build"
    inc.mkdir()
    for h in ("cuda.h", "nvml.h"):
        (inc / h).symlink_to(SHIM / ".deps" / "include" / h)
    env = {**os.environ, "PIP": "false"}  # any pip call would fail the build
    subprocess.run(
        ["make", "-s", "-C", str(SHIM), f"B={build}", f"INC={inc}", str(build / "libtessera.so")],
        check=True,
        timeout=300,
        env=env,
    )
    assert (build / "libtessera.so").is_file()
    missing = subprocess.run(
        ["make", "-s", "-C", str(SHIM), f"B={tmp_path / 'b'}", f"INC={tmp_path / 'no'}", "headers"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert missing.returncode != 0 and "not found (INC=" in missing.stderr


def test_the_kit_builds_with_this_machines_headers_when_the_wheels_are_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU machine's path: no shim/.deps, headers under CUDA_HOME, no registry."""
    subprocess.run(["make", "-s", "-C", str(SHIM), "headers"], check=True, timeout=300)
    tree = tmp_path / "shim"
    shutil.copytree(SHIM, tree, ignore=shutil.ignore_patterns(".deps", "build", "__pycache__"))
    toolkit = tmp_path / "cuda" / "targets" / "x86_64-linux" / "include"
    toolkit.mkdir(parents=True)
    for h in ("cuda.h", "nvml.h"):
        (toolkit / h).symlink_to(SHIM / ".deps" / "include" / h)
    monkeypatch.setattr(kit, "SHIM_DIR", tree)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("PIP", "false")
    opts = kit.parse_args(["--out", str(tmp_path / "out")])
    result = kit.Kit(opts).build()
    assert result.status == "PASS", result
    assert "this machine's headers" in result.reason and str(toolkit) in result.reason
    assert (tree / "build" / "gpu" / "libtessera.so").is_file()
    assert not (tree / ".deps").exists()


@pytest.mark.parametrize(
    ("card_free", "ballast"),
    [(80 * 1024 - 600, 80 * 1024 - 600 - 4096 - 4096 - 2048), (140 * 1024, 140 * 1024 - 10240)],
)
def test_the_oversubscription_section_fills_the_card_around_two_resident_parts(
    card_free: int, ballast: int
) -> None:
    plan = kit.oversub_plan(card_free, 4096, 4096)
    assert (plan.slice_mib, plan.touch_mib) == (6144, 5120)  # 1.5 x 4096; less a context
    assert plan.touch_mib % kit.OVERSUB_BLOCK_MIB == 0
    assert plan.touch_mib > plan.resident_mib  # so it must spill
    assert plan.neighbour_alloc_mib == 4096 - kit.CONTEXT_ALLOWANCE_MIB
    assert plan.ballast_mib == ballast
    # what may not leave the card: ballast, both resident parts, two contexts: the free memory
    room = plan.ballast_mib + plan.resident_mib + plan.neighbour_mib
    assert room + 2 * kit.CONTEXT_ALLOWANCE_MIB == card_free


def test_the_slice_is_the_resident_part_times_the_factor_rounded_up() -> None:
    assert kit.oversub_plan(100_000, 4097, 4096).slice_mib == 6146  # 6145.5 up
    assert kit.oversub_plan(100_000, 4096, 4096, factor=2).slice_mib == 8192


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((10_000, 1024, 4096), "not past its 1024 MiB resident part"),
        ((100_000, 16384, 2048), "would not fit beside the ballast"),
        ((9000, 4096, 4096), "the card has 9000 MiB free; the section needs more than 10240 MiB"),
    ],
)
def test_an_oversubscription_section_that_cannot_show_it_says_why(
    args: tuple[int, int, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        kit.oversub_plan(*args)


def test_the_touch_checksum_is_the_sum_of_each_blocks_value() -> None:
    per_block = 256 * MiB // 4
    assert kit.touch_checksum(256, 1) == per_block
    assert kit.touch_checksum(256, 20) == per_block * sum(range(1, 21))


# ---- the whole kit on the fake driver ------------------------------------------------------

DRIVER_CHECKS = [
    "slice reported (driver)",
    "out of memory at the slice (cuMemAlloc)",
    "host NVML within slice + tolerance (cuMemAlloc)",
    "nvidia-smi inside reports the slice",
    "two processes share one slice",
    "a SIGKILLed holder's memory returns",
    "30 % compute limit",
    "two containers at 30 % and 60 % share one card",
    "out of memory at the slice (cuMemCreate)",
    "host NVML within slice + tolerance (cuMemCreate)",
]
NEEDS_A_GPU = [
    "slice reported (torch)",
    "fill (torch)",
    "overhead of a training loop",
    "fill (cupy)",
    "oversubscribed slice",
]


def test_the_kit_passes_on_the_fake_driver(tmp_path: Path) -> None:
    rc, body = run_kit(tmp_path)
    checks = by_name(body)
    assert body["mode"] == "fake" and body["tolerance_mib"] == kit.TOLERANCE_MIB
    assert checks["build"]["status"] == "PASS"
    for name in DRIVER_CHECKS:
        assert checks[name]["status"] == "PASS", checks[name]
    for name in NEEDS_A_GPU:
        assert checks[name]["status"] == "SKIP" and "needs a real GPU" in checks[name]["reason"]
    assert rc == 0
    # what the card saw: the fake context (300 MiB) is part of what fills the slice
    fill = checks["out of memory at the slice (cuMemAlloc)"]["data"]
    assert fill["oom"] and fill["allocated"] + 300 * MiB <= body["slice_mib"] * MiB
    assert fill["host_nvml_used"] == fill["allocated"] + 300 * MiB
    # The check's PASS is about the ratio; each container must also be held near its own cap
    # (both held at half their share would keep the ratio).
    share = checks["two containers at 30 % and 60 % share one card"]["data"]
    assert 0.20 <= share["a"] / share["unlimited"] <= 0.40, share
    assert 0.50 <= share["b"] / share["unlimited"] <= 0.70, share
    assert (tmp_path / "logs").is_dir() and any((tmp_path / "logs").iterdir())


def test_the_host_view_holds_when_nvml_answers_with_host_pids(tmp_path: Path) -> None:
    """Where the kit itself runs in a pid namespace (a GPU machine that is a container), NVML
    lists host pids: the kit counts what appeared on the card during the check instead."""
    os.environ["FAKE_NVML_PID_OFFSET"] = "100000"
    try:
        rc, body = run_kit(tmp_path, "--only", "fill (driver),SIGKILL")
    finally:
        del os.environ["FAKE_NVML_PID_OFFSET"]
    checks = by_name(body)
    assert rc == 0, checks
    assert body["info"]["nvml_pids"].startswith("host pids")
    fill = checks["host NVML within slice + tolerance (cuMemAlloc)"]
    assert fill["status"] == "PASS" and fill["data"]["host_nvml_used"] > 0
    assert checks["a SIGKILLed holder's memory returns"]["status"] == "PASS"


def test_without_the_shim_the_kit_fails(tmp_path: Path) -> None:
    only = "slice reported (driver),fill (driver),fill (vmm),two processes,SIGKILL,nvidia-smi"
    rc, body = run_kit(tmp_path, "--no-preload", "--only", only)
    checks = by_name(body)
    assert rc == 1
    for name in DRIVER_CHECKS:
        if "compute" in name or "share one card" in name:
            continue
        assert checks[name]["status"] == "FAIL", checks[name]


def test_bad_arguments_are_refused_before_anything_runs(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(KIT), "--fake", "--out", str(tmp_path), "--slice-mib", "100"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "--slice-mib must be at least 1024" in proc.stderr
    assert not (tmp_path / "results.json").exists()
