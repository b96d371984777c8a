"""Read a container's Tessera shared region: per-device limits and usage, per-process slots.

The region is the ABI between the shim (``shim/region_layout.h``, C) and the node plugin.
This module mirrors the C layout with :mod:`ctypes`; ``tests/shim/test_shared_region.py``
compares every offset and size with what the C compiler produces, so a change on one side
without the other fails the tests.

Reading needs no lock: the shim updates naturally aligned 64-bit counters atomically, and a
snapshot is a plain copy of the file.  A process slot whose owner died keeps its count until
a process of the container next needs the room (the shim reclaims it then); the plugin, in
another pid namespace, cannot tell, so it reports slots as they are.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

REGION_MAGIC = 0x3141524553534554  # b"TESSERA1", little-endian
REGION_VERSION = 1
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
        ("_pad0", ctypes.c_uint32),
        ("created_unix_ns", ctypes.c_uint64),
        ("_reserved", ctypes.c_uint8 * 16),
    ]


class RegionDevice(ctypes.Structure):
    """``struct tessera_region_device`` (32 bytes)."""

    _fields_ = [
        ("mem_limit_bytes", ctypes.c_uint64),
        ("card_total_bytes", ctypes.c_uint64),
        ("core_limit_pct", ctypes.c_uint32),
        ("_pad0", ctypes.c_uint32),
        ("_reserved", ctypes.c_uint64),
    ]


class RegionProc(ctypes.Structure):
    """``struct tessera_region_proc`` (192 bytes)."""

    _fields_ = [
        ("pid", ctypes.c_uint32),
        ("reaper", ctypes.c_uint32),
        ("start_time", ctypes.c_uint64),
        ("used", ctypes.c_uint64 * MAX_DEVICES),
        ("_reserved", ctypes.c_uint8 * 48),
    ]


class Region(ctypes.Structure):
    """``struct tessera_region``: header, devices, process slots (12864 bytes)."""

    _fields_ = [
        ("hdr", RegionHeader),
        ("dev", RegionDevice * MAX_DEVICES),
        ("proc", RegionProc * MAX_PROCS),
    ]


REGION_SIZE = ctypes.sizeof(Region)


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


@dataclass(frozen=True)
class ProcessUsage:
    """One occupied process slot: a process of the container that has allocated device memory."""

    slot: int
    pid: int  # in the container's pid namespace
    start_time: int  # clock ticks since boot
    used_bytes: tuple[int, ...]  # per device ordinal


@dataclass(frozen=True)
class RegionSnapshot:
    """What a container uses, as of one read of its region."""

    version: int
    created_unix_ns: int
    devices: tuple[DeviceUsage, ...]  # devices with a limit, a known card or any usage
    processes: tuple[ProcessUsage, ...]

    def device(self, index: int) -> DeviceUsage | None:
        """The entry for device ``index``, or None when the region says nothing about it."""
        for dev in self.devices:
            if dev.index == index:
                return dev
        return None


def parse_region(data: bytes) -> RegionSnapshot:
    """Decode the bytes of a region file; raises RegionError when they are not one."""
    if len(data) < ctypes.sizeof(RegionHeader):
        raise RegionError(f"{len(data)} bytes is too short for a region header")
    hdr = RegionHeader.from_buffer_copy(data[: ctypes.sizeof(RegionHeader)])
    if int(hdr.magic) != REGION_MAGIC:
        raise RegionError(f"bad magic {int(hdr.magic):#x}, want {REGION_MAGIC:#x}")
    if int(hdr.version) != REGION_VERSION:
        raise RegionError(f"region version {int(hdr.version)}, this reader knows {REGION_VERSION}")
    if len(data) != REGION_SIZE or int(hdr.region_size) != REGION_SIZE:
        raise RegionError(
            f"region is {len(data)} bytes (header says {int(hdr.region_size)}), want {REGION_SIZE}"
        )
    if int(hdr.max_devices) != MAX_DEVICES or int(hdr.max_procs) != MAX_PROCS:
        raise RegionError("region was built for other device or process counts")
    region = Region.from_buffer_copy(data)
    hwm = min(int(region.hdr.proc_hwm), MAX_PROCS)
    processes = []
    for slot in range(hwm):
        proc = region.proc[slot]
        if int(proc.pid) == 0:
            continue
        processes.append(
            ProcessUsage(
                slot=slot,
                pid=int(proc.pid),
                start_time=int(proc.start_time),
                used_bytes=tuple(int(v) for v in proc.used),
            )
        )
    devices = []
    for index in range(MAX_DEVICES):
        dev = region.dev[index]
        used = sum(p.used_bytes[index] for p in processes)
        limit, total, core = (
            int(dev.mem_limit_bytes),
            int(dev.card_total_bytes),
            int(dev.core_limit_pct),
        )
        if limit or total or core or used:
            devices.append(
                DeviceUsage(
                    index=index,
                    limit_bytes=limit,
                    card_total_bytes=total,
                    core_limit_pct=core,
                    used_bytes=used,
                )
            )
    return RegionSnapshot(
        version=int(region.hdr.version),
        created_unix_ns=int(region.hdr.created_unix_ns),
        devices=tuple(devices),
        processes=tuple(processes),
    )


def read_region(path: str | os.PathLike[str]) -> RegionSnapshot:
    """Read the region file at ``path``; raises RegionError (or OSError) when it cannot be used."""
    with open(path, "rb") as f:
        data = f.read(REGION_SIZE + 1)
    return parse_region(data)
