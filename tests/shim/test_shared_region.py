"""The node plugin's view of the shim's shared region.

The Python mirror (nodeplugin/shared_region.py) must match the C layout byte for byte: a
small C program built from shim/region_layout.h prints every offset and size, and these
tests compare.  read_region is then checked against a region written by the real shim.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nodeplugin import shared_region as sr

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "shim"
BUILD = SHIM / "build"
MiB = 1 << 20

STRUCTS: dict[str, type[ctypes.Structure]] = {
    "tessera_region_header": sr.RegionHeader,
    "tessera_region_device": sr.RegionDevice,
    "tessera_region_proc": sr.RegionProc,
    "tessera_region": sr.Region,
}
CONSTANTS = {
    "TESSERA_REGION_MAGIC": sr.REGION_MAGIC,
    "TESSERA_REGION_VERSION": sr.REGION_VERSION,
    "TESSERA_MAX_DEVICES": sr.MAX_DEVICES,
    "TESSERA_MAX_PROCS": sr.MAX_PROCS,
}


def make(*targets: str) -> None:
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.fail("make and a C compiler are needed to build the shim's layout probe")
    subprocess.run(["make", "-s", "-C", str(SHIM), *targets], check=True)


@pytest.fixture(scope="module")
def c_layout() -> dict[str, tuple[int, int]]:
    make("build/region_offsets")
    out = subprocess.run(
        [str(BUILD / "region_offsets")], check=True, capture_output=True, text=True
    ).stdout
    layout = {}
    for line in out.splitlines():
        name, offset, size = line.split()
        layout[name] = (int(offset), int(size))
    return layout


def test_every_c_field_has_the_same_offset_and_size_in_python(
    c_layout: dict[str, tuple[int, int]],
) -> None:
    seen = set()
    for name, (offset, size) in c_layout.items():
        if name.startswith("const."):
            continue
        struct_name, _, field = name.partition(".")
        cls = STRUCTS[struct_name]
        if not field:
            assert ctypes.sizeof(cls) == size, f"sizeof(struct {struct_name})"
            continue
        descriptor = getattr(cls, field)
        assert (descriptor.offset, descriptor.size) == (offset, size), name
        seen.add((struct_name, field))
    for struct_name, cls in STRUCTS.items():
        for field, *_ in cls._fields_:
            assert (struct_name, field) in seen, f"{struct_name}.{field} is not in the C layout"


def test_constants_match_the_c_header(c_layout: dict[str, tuple[int, int]]) -> None:
    for name, value in CONSTANTS.items():
        assert c_layout[f"const.{name}"][0] == value, name


def blank_region() -> sr.Region:
    region = sr.Region()
    region.hdr.magic = sr.REGION_MAGIC
    region.hdr.version = sr.REGION_VERSION
    region.hdr.header_size = ctypes.sizeof(sr.RegionHeader)
    region.hdr.region_size = sr.REGION_SIZE
    region.hdr.max_devices = sr.MAX_DEVICES
    region.hdr.max_procs = sr.MAX_PROCS
    return region


def test_parse_sums_process_slots_per_device() -> None:
    region = blank_region()
    region.hdr.proc_hwm = 3
    region.dev[0].mem_limit_bytes = 1024 * MiB
    region.dev[1].core_limit_pct = 30
    region.proc[0].pid = 10
    region.proc[0].used[0] = 100 * MiB
    region.proc[2].pid = 12
    region.proc[2].used[0] = 50 * MiB
    region.proc[2].used[1] = 7 * MiB
    snap = sr.parse_region(bytes(region))
    assert [p.pid for p in snap.processes] == [10, 12]
    dev0, dev1 = snap.device(0), snap.device(1)
    assert dev0 is not None and dev1 is not None
    assert (dev0.limit_bytes, dev0.used_bytes) == (1024 * MiB, 150 * MiB)
    assert (dev1.core_limit_pct, dev1.used_bytes) == (30, 7 * MiB)
    assert snap.device(2) is None


def test_parse_reads_spilled_bytes_per_process_and_device() -> None:
    region = blank_region()
    region.hdr.proc_hwm = 2
    region.dev[0].mem_limit_bytes = 1024 * MiB
    region.proc[0].pid = 10
    region.proc[0].used[0] = 600 * MiB
    region.proc[0].spilled[0] = 200 * MiB
    region.proc[1].pid = 11
    region.proc[1].used[0] = 300 * MiB
    region.proc[1].spilled[0] = 100 * MiB
    snap = sr.parse_region(bytes(region))
    dev = snap.device(0)
    assert dev is not None
    assert (dev.used_bytes, dev.spilled_bytes) == (900 * MiB, 300 * MiB)
    assert dev.resident_bytes == 600 * MiB
    assert [p.spilled_bytes[0] for p in snap.processes] == [200 * MiB, 100 * MiB]


def test_a_release_seen_half_way_never_spills_more_than_is_used() -> None:
    region = blank_region()
    region.hdr.proc_hwm = 1
    region.proc[0].pid = 10
    region.proc[0].used[0] = 100 * MiB
    region.proc[0].spilled[0] = 300 * MiB  # used already released, spilled not yet
    dev = sr.parse_region(bytes(region)).device(0)
    assert dev is not None
    assert (dev.spilled_bytes, dev.resident_bytes) == (100 * MiB, 0)


def blank_region_v2(version: int) -> sr.RegionV2:
    """An empty region as a shim of version 1 or 2 makes it."""
    region = sr.RegionV2()
    region.hdr.magic = sr.REGION_MAGIC
    region.hdr.version = version
    region.hdr.header_size = ctypes.sizeof(sr.RegionHeader)
    region.hdr.region_size = sr.REGION_SIZES[version]
    region.hdr.max_devices = sr.MAX_DEVICES
    region.hdr.max_procs = sr.MAX_PROCS
    return region


@pytest.mark.parametrize("version", [1, 2])
def test_a_region_of_an_older_shim_reads_as_one_that_spilled_nothing(version: int) -> None:
    region = blank_region_v2(version)
    region.hdr.proc_hwm = 1
    region.proc[0].pid = 10
    region.proc[0].used[0] = 100 * MiB
    snap = sr.parse_region(bytes(region))
    dev = snap.device(0)
    assert snap.version == version and dev is not None
    assert (dev.used_bytes, dev.spilled_bytes, dev.resident_bytes) == (100 * MiB, 0, 100 * MiB)
    assert sr.parse_head(bytes(region)[: sr.HEAD_SIZE]).version == version


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: struct.pack_into("<Q", b, 0, 0x1234), "bad magic"),
        (lambda b: struct.pack_into("<I", b, 8, 99), "region version 99"),
        (lambda b: struct.pack_into("<I", b, 8, 2), "want 12864"),  # a version 2 header on a 3
    ],
)
def test_parse_refuses_foreign_regions(mutate: Callable[[bytearray], None], message: str) -> None:
    data = bytearray(bytes(blank_region()))
    mutate(data)
    with pytest.raises(sr.RegionError, match=message):
        sr.parse_region(bytes(data))


def test_a_version_1_region_still_reads() -> None:
    """Containers started before an upgrade keep their version 1 regions: the layout of
    version 2, whose named words were reserved (zero) there."""
    region = blank_region_v2(1)
    region.hdr.proc_hwm = 1
    region.dev[0].mem_limit_bytes = 512 * MiB
    region.proc[0].pid = 7
    region.proc[0].used[0] = 5 * MiB
    snap = sr.parse_region(bytes(region))
    assert snap.version == 1
    dev = snap.device(0)
    assert dev is not None and (dev.limit_bytes, dev.used_bytes, dev.launches) == (
        512 * MiB,
        5 * MiB,
        0,
    )
    head = sr.parse_head(bytes(region)[: sr.HEAD_SIZE])
    assert head.version == 1 and not head.can_hold


def test_head_and_hold_round_trip_through_the_file(tmp_path: Path) -> None:
    region = blank_region()
    region.dev[1].launches = 41
    path = tmp_path / "region"
    path.write_bytes(bytes(region))
    fd = os.open(path, os.O_RDWR)
    try:
        head = sr.read_head(fd)
        assert head.can_hold and head.launches[:3] == (0, 41, 0)
        assert (head.hold_mask, head.hold_until_ns) == (0, 0)
        sr.write_hold(fd, 0b10, 123_456_789)
        head = sr.read_head(fd)
        assert (head.hold_mask, head.hold_until_ns) == (0b10, 123_456_789)
        sr.write_hold(fd, 0, None)  # let go: the time stays, the mask alone says so
        assert (sr.read_head(fd).hold_mask, sr.read_head(fd).hold_until_ns) == (0, 123_456_789)
    finally:
        os.close(fd)
    snap = sr.read_region(path)
    assert (snap.hold_mask, snap.hold_until_ns) == (0, 123_456_789)
    assert os.path.getsize(path) == sr.REGION_SIZE  # nothing written past the layout


def test_a_short_head_is_refused() -> None:
    with pytest.raises(sr.RegionError, match="too short"):
        sr.parse_head(b"")
    with pytest.raises(sr.RegionError, match=f"want {sr.HEAD_SIZE}"):
        sr.parse_head(bytes(blank_region())[:100])


def test_parse_refuses_short_files() -> None:
    with pytest.raises(sr.RegionError, match="too short"):
        sr.parse_region(b"TESSERA")
    with pytest.raises(sr.RegionError, match="want 21056"):
        sr.parse_region(bytes(blank_region())[:1000])


@pytest.mark.parametrize(("resident", "spilled_mib"), [(None, 0), ("100", 300)])
def test_read_region_sees_what_the_shim_counts(
    tmp_path: Path, resident: str | None, spilled_mib: int
) -> None:
    """With a resident part of 100 MiB the holder's 300 MiB pass it: served managed, and the
    region says they are spilled."""
    make("build/libtessera.so", "build/t_proc", "build/fake/libcuda.so.1")
    region_path = tmp_path / "region"
    ready = tmp_path / "ready"
    env = dict(
        os.environ,
        LD_PRELOAD=str(BUILD / "libtessera.so"),
        LD_LIBRARY_PATH=str(BUILD / "fake"),
        FAKE_CUDA_MEM_MIB="16384",
        TESSERA_SHARED_REGION=str(region_path),
        TESSERA_DEVICE_MEMORY_LIMIT_0="1024",
        TESSERA_DEVICE_CORE_LIMIT_0="40",
    )
    if resident is not None:
        env["TESSERA_DEVICE_MEMORY_RESIDENT_0"] = resident
    holder = subprocess.Popen([str(BUILD / "t_proc"), "hold", "300", str(ready)], env=env)
    try:
        deadline = time.monotonic() + 10
        while not ready.exists():
            assert holder.poll() is None, "the holder exited"
            assert time.monotonic() < deadline, "the holder never got ready"
            time.sleep(0.02)
        snap = sr.read_region(region_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert snap.version == sr.REGION_VERSION
    dev = snap.device(0)
    assert dev is not None
    assert dev.limit_bytes == 1024 * MiB
    assert dev.card_total_bytes == 16384 * MiB
    assert dev.core_limit_pct == 40
    assert dev.used_bytes == 300 * MiB
    assert dev.spilled_bytes == spilled_mib * MiB
    assert dev.resident_bytes == (300 - spilled_mib) * MiB
    [proc] = snap.processes
    assert proc.pid == holder.pid
    assert proc.used_bytes[0] == 300 * MiB
    assert proc.spilled_bytes[0] == spilled_mib * MiB
    assert proc.start_time > 0
