"""The memory limit through Python ctypes (CDLL("libcuda.so.1") + attribute lookup = dlsym).

usage: t_ctypes.py report|refuse|realloc   (TESSERA_DEVICE_MEMORY_LIMIT_0 set, shim preloaded)
"""

import ctypes
import os
import sys

MiB = 1 << 20
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2


class FakeStats(ctypes.Structure):
    """struct fake_cuda_stats (tests/fake/fake.h)."""

    _fields_ = [
        ("alloc_calls", ctypes.c_uint64),
        ("free_calls", ctypes.c_uint64),
        ("ptsz_calls", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("used_bytes", ctypes.c_uint64 * 4),
        ("managed_calls", ctypes.c_uint64),
        ("spilled_bytes", ctypes.c_uint64 * 4),
    ]


def fail(msg):
    print(f"FAIL t_ctypes: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    case = sys.argv[1]
    limit = int(os.environ["TESSERA_DEVICE_MEMORY_LIMIT_0"]) * MiB
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    cu.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    cu.cuMemGetInfo_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t)] * 2
    cu.cuDeviceTotalMem_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]

    def stats():
        s = FakeStats()
        cu.fake_cuda_stats(ctypes.byref(s))
        return s

    def info():
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) != CUDA_SUCCESS:
            fail("cuMemGetInfo_v2 failed")
        return free.value, total.value

    def alloc(n):
        p = ctypes.c_uint64()
        return cu.cuMemAlloc_v2(ctypes.byref(p), n), p.value

    if cu.cuInit(0) != CUDA_SUCCESS:
        fail("cuInit failed")
    part = limit * 6 // 10
    if case == "report":
        free, total = info()
        dev_total = ctypes.c_size_t()
        cu.cuDeviceTotalMem_v2(ctypes.byref(dev_total), 0)
        if (free, total, dev_total.value) != (limit, limit, limit):
            fail(f"free/total/device total {free}/{total}/{dev_total.value}, want {limit}")
    elif case == "refuse":
        r, _ = alloc(part)
        if r != CUDA_SUCCESS:
            fail(f"first allocation returned {r}")
        before = stats().alloc_calls
        r, _ = alloc(part)
        if r != CUDA_ERROR_OUT_OF_MEMORY:
            fail(f"allocation past the limit returned {r}")
        if stats().alloc_calls != before:
            fail("the refused allocation reached the driver")
    elif case == "realloc":
        r, a = alloc(part)
        if r != CUDA_SUCCESS or alloc(part)[0] != CUDA_ERROR_OUT_OF_MEMORY:
            fail("the limit did not hold")
        if cu.cuMemFree_v2(a) != CUDA_SUCCESS:
            fail("free failed")
        r, _ = alloc(part)
        if r != CUDA_SUCCESS:
            fail(f"allocation after free returned {r}")
        if info()[0] != limit - part:
            fail(f"free {info()[0]}, want {limit - part}")
    else:
        fail(f"unknown case {case}")


main()
