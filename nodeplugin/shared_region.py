"""Read a container's Tessera shared region: per-device limits and usage, per-process slots.

The region is the ABI between the shim (``shim/region_layout.h``, C) and the node plugin.
This module mirrors the C layout with :mod:`ctypes`; ``tests/shim/test_shared_region.py``
compares every offset and size with what the C compiler produces, so a change on one side
without the other fails the tests.

Reading needs no lock: the shim updates naturally aligned 64-bit counters atomically, and a
snapshot is a plain copy of the file.  A process slot whose owner died keeps its count until
a process of the container next needs the room (the shim reclaims it then); the plugin, in
another pid namespace, cannot tell, so it reports slots as they are.

Two fields are the plugin's to write, no one else's: ``hold_mask`` and ``hold_until_ns`` (task
priority, :mod:`nodeplugin.priority`).  They are written with ``pwrite`` of one aligned word
each, never through a mapping: the file lives in a directory the container can write, and a
mapping of a file the container truncates would kill the plugin with SIGBUS.

Version 2 gave names to words version 1 kept reserved (zero), at the same offsets and size, so
a version 1 region (a container started before an upgrade) still reads: it counts no launches
and is never asked to hold.  Version 3 grew each process slot by the bytes it spilled past the
device's resident part (virtual device memory); the header and the devices are as before, so
the head reads the same in every version, and a version 1 or 2 region reads as one that spilled
nothing.
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import dataclass

REGION_MAGIC = 0x3141524553534554  # b"TESSERA1", little-endian
REGION_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 1 and 2 share a layout (1 has no launch counts, cannot be held)
MAX_DEVICES = 16
MAX_PROCS = 64


class RegionHeader(ctypes.Structure):
    """``struct tessera_region_header`` (64 bytes)."""

    _fields_ = [
        ("magic", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("header_size", ctypes.c_uint32),
        ("region_size", ctypes.c_uint64),
        ("max_devices", ctypes.c_uint32),
        ("max_procs", ctypes.c_uint32),
        ("proc_hwm", ctypes.c_uint32),
        ("hold_mask", ctypes.c_uint32),
        ("created_unix_ns", ctypes.c_uint64),
        ("hold_until_ns", ctypes.c_uint64),
        ("_reserved", ctypes.c_uint8 * 8),
    ]


class RegionDevice(ctypes.Structure):
    """``struct tessera_region_device`` (32 bytes)."""

    _fields_ = [
        ("mem_limit_bytes", ctypes.c_uint64),
        ("card_total_bytes", ctypes.c_uint64),
        ("core_limit_pct", ctypes.c_uint32),
        ("_pad0", ctypes.c_uint32),
        ("launches", ctypes.c_uint64),
    ]


class RegionProc(ctypes.Structure):
    """``struct tessera_region_proc`` (320 bytes)."""

    _fields_ = [
        ("pid", ctypes.c_uint32),
        ("reaper", ctypes.c_uint32),
        ("start_time", ctypes.c_uint64),
        ("used", ctypes.c_uint64 * MAX_DEVICES),
        ("spill_busy", ctypes.c_uint32),
        ("spill_gen", ctypes.c_uint32),
        ("_reserved", ctypes.c_uint8 * 40),
        ("spilled", ctypes.c_uint64 * MAX_DEVICES),
    ]


class RegionProcV2(ctypes.Structure):
    """A process slot of a version 1 or 2 region (192 bytes): no spilled counts."""

    _fields_ = [
        ("pid", ctypes.c_uint32),
        ("reaper", ctypes.c_uint32),
        ("start_time", ctypes.c_uint64),
        ("used", ctypes.c_uint64 * MAX_DEVICES),
        ("_reserved", ctypes.c_uint8 * 48),
    ]


class Region(ctypes.Structure):
    """``struct tessera_region``: header, devices, process slots (21056 bytes)."""

    _fields_ = [
        ("hdr", RegionHeader),
        ("dev", RegionDevice * MAX_DEVICES),
        ("proc", RegionProc * MAX_PROCS),
    ]


class RegionV2(ctypes.Structure):
    """A version 1 or 2 region (12864 bytes)."""

    _fields_ = [
        ("hdr", RegionHeader),
        ("dev", RegionDevice * MAX_DEVICES),
        ("proc", RegionProcV2 * MAX_PROCS),
    ]


REGION_SIZE = ctypes.sizeof(Region)
# The size of a whole region, by version.
REGION_SIZES = {1: ctypes.sizeof(RegionV2), 2: ctypes.sizeof(RegionV2), 3: REGION_SIZE}
# The header and the devices: all a look at launches and holds needs to read.
HEAD_SIZE = ctypes.sizeof(RegionHeader) + MAX_DEVICES * ctypes.sizeof(RegionDevice)
HOLD_MASK_OFFSET: int = RegionHeader.hold_mask.offset
HOLD_UNTIL_OFFSET: int = RegionHeader.hold_until_ns.offset


class RegionError(ValueError):
    """The file is not a region this code understands (missing, short, other magic or version)."""


@dataclass(frozen=True)
class DeviceUsage:
    """One device of the container, by its ordinal inside the container."""

    index: int
    limit_bytes: int  # 0 = no memory limit
    card_total_bytes: int  # 0 = not yet known (no process has initialised CUDA)
    core_limit_pct: int  # 0 = no compute limit
    used_bytes: int  # sum over the process slots
    launches: int = 0  # kernel launches so far (counted only with a task priority)
    spilled_bytes: int = 0  # of used_bytes: served as managed memory past the resident part

    @property
    def resident_bytes(self) -> int:
        """What the container holds on the card: used less spilled."""
        return self.used_bytes - self.spilled_bytes


@dataclass(frozen=True)
class ProcessUsage:
    """One occupied process slot: a process of the container that has allocated device memory."""

    slot: int
    pid: int  # in the container's pid namespace
    start_time: int  # clock ticks since boot
    used_bytes: tuple[int, ...]  # per device ordinal
    spilled_bytes: tuple[int, ...] = (0,) * MAX_DEVICES  # per device ordinal, each <= used_bytes


@dataclass(frozen=True)
class RegionSnapshot:
    """What a container uses, as of one read of its region."""

    version: int
    created_unix_ns: int
    devices: tuple[DeviceUsage, ...]  # devices with a limit, a known card or any usage
    processes: tuple[ProcessUsage, ...]
    hold_mask: int = 0  # bit i: the plugin asks the container to hold launches on device i
    hold_until_ns: int = 0  # CLOCK_MONOTONIC; the mask counts only until then

    def device(self, index: int) -> DeviceUsage | None:
        """The entry for device ``index``, or None when the region says nothing about it."""
        for dev in self.devices:
            if dev.index == index:
                return dev
        return None


def _check_header(data: bytes, size: int | None) -> RegionHeader:
    """The header of ``data``, a whole region (``size`` None: the size of its version) or its
    head (``size`` HEAD_SIZE); RegionError when it is not one this reader knows."""
    if len(data) < ctypes.sizeof(RegionHeader):
        raise RegionError(f"{len(data)} bytes is too short for a region header")
    hdr = RegionHeader.from_buffer_copy(data[: ctypes.sizeof(RegionHeader)])
    if int(hdr.magic) != REGION_MAGIC:
        raise RegionError(f"bad magic {int(hdr.magic):#x}, want {REGION_MAGIC:#x}")
    if int(hdr.version) not in READABLE_VERSIONS:
        raise RegionError(
            f"region version {int(hdr.version)}, this reader knows "
            + " and ".join(str(v) for v in READABLE_VERSIONS)
        )
    whole = REGION_SIZES[int(hdr.version)]
    want = whole if size is None else size
    if len(data) != want or int(hdr.region_size) != whole:
        raise RegionError(
            f"region is {len(data)} bytes (header says {int(hdr.region_size)}), want {want}"
        )
    if int(hdr.max_devices) != MAX_DEVICES or int(hdr.max_procs) != MAX_PROCS:
        raise RegionError("region was built for other device or process counts")
    return hdr


def parse_region(data: bytes) -> RegionSnapshot:
    """Decode the bytes of a region file; raises RegionError when they are not one."""
    hdr = _check_header(data, None)
    region: Region | RegionV2 = (
        Region.from_buffer_copy(data) if int(hdr.version) >= 3 else RegionV2.from_buffer_copy(data)
    )
    hwm = min(int(region.hdr.proc_hwm), MAX_PROCS)
    processes = []
    for slot in range(hwm):
        proc = region.proc[slot]
        if int(proc.pid) == 0:
            continue
        used_by_dev = tuple(int(v) for v in proc.used)
        # A release under way may be seen with spilled still counted and used already not.
        spilled_by_dev = (
            tuple(min(int(v), u) for v, u in zip(proc.spilled, used_by_dev, strict=True))
            if isinstance(proc, RegionProc)
            else (0,) * MAX_DEVICES
        )
        processes.append(
            ProcessUsage(
                slot=slot,
                pid=int(proc.pid),
                start_time=int(proc.start_time),
                used_bytes=used_by_dev,
                spilled_bytes=spilled_by_dev,
            )
        )
    devices = []
    for index in range(MAX_DEVICES):
        dev = region.dev[index]
        used = sum(p.used_bytes[index] for p in processes)
        spilled = sum(p.spilled_bytes[index] for p in processes)
        limit, total, core, launches = (
            int(dev.mem_limit_bytes),
            int(dev.card_total_bytes),
            int(dev.core_limit_pct),
            int(dev.launches),
        )
        if limit or total or core or used or launches:
            devices.append(
                DeviceUsage(
                    index=index,
                    limit_bytes=limit,
                    card_total_bytes=total,
                    core_limit_pct=core,
                    used_bytes=used,
                    launches=launches,
                    spilled_bytes=spilled,
                )
            )
    return RegionSnapshot(
        version=int(region.hdr.version),
        created_unix_ns=int(region.hdr.created_unix_ns),
        devices=tuple(devices),
        processes=tuple(processes),
        hold_mask=int(region.hdr.hold_mask),
        hold_until_ns=int(region.hdr.hold_until_ns),
    )


def read_region(path: str | os.PathLike[str]) -> RegionSnapshot:
    """Read the region file at ``path``; raises RegionError (or OSError) when it cannot be used."""
    with open(path, "rb") as f:
        data = f.read(REGION_SIZE + 1)
    return parse_region(data)


@dataclass(frozen=True)
class RegionHead:
    """The part of a region that task priority looks at, from one read of its head."""

    version: int
    hold_mask: int
    hold_until_ns: int
    launches: tuple[int, ...]  # per device ordinal

    @property
    def can_hold(self) -> bool:
        """Only a shim of version 2 or later counts launches and honours a hold."""
        return self.version >= 2


def parse_head(data: bytes) -> RegionHead:
    """Decode the first HEAD_SIZE bytes of a region file; RegionError when they are not one."""
    hdr = _check_header(data, HEAD_SIZE)
    devices = (RegionDevice * MAX_DEVICES).from_buffer_copy(data, ctypes.sizeof(RegionHeader))
    return RegionHead(
        version=int(hdr.version),
        hold_mask=int(hdr.hold_mask),
        hold_until_ns=int(hdr.hold_until_ns),
        launches=tuple(int(d.launches) for d in devices),
    )


def read_head(fd: int) -> RegionHead:
    """The head of the region open on ``fd`` (a short file is a RegionError, not a crash)."""
    return parse_head(os.pread(fd, HEAD_SIZE, 0))


def write_hold(fd: int, mask: int, until_ns: int | None) -> None:
    """Ask the container of the region open on ``fd`` to hold launches on the devices of
    ``mask`` until ``until_ns`` (CLOCK_MONOTONIC), or, with ``mask`` 0, to hold none.

    The time goes first and the mask last, so a shim that sees a new bit also sees a time
    that makes it count; each is one aligned word, which a reader sees whole."""
    if until_ns is not None:
        os.pwrite(fd, struct.pack("<Q", until_ns), HOLD_UNTIL_OFFSET)
    os.pwrite(fd, struct.pack("<I", mask), HOLD_MASK_OFFSET)
