"""One process of a simulated container, for the proof kit (kit.py starts it).

It runs with the environment a node plugin would give a container (the shim preloaded,
TESSERA_* limits, the container's shared region) and does one thing, reporting on stdout
in lines that start with ``@@tessera `` followed by JSON: ``{"event": ...}`` while it runs,
``{"result": ...}`` last.  A role that holds memory waits, after its ``holding`` event,
until its stdin is closed, so the kit can look at the card from outside meanwhile.

Roles:
  report  API                 the slice as the process sees it
  fill    API BLOCK_MIB CAP_MIB  allocate BLOCK_MIB at a time until out of memory (or CAP_MIB)
  hold    MIB                 allocate MIB through the driver API, then hold it
  alloc   SIZE                one allocation through the driver API: admitted or refused; SIZE
                              is MiB, or free+MIB / free-MIB / free/2 (of what this process sees
                              free, its own context already charged)
  matmul  SECONDS WARMUP [sync]  matrix products through PyTorch: products per second
  launch  SECONDS WARMUP [sync]  kernel launches through the driver API (the fake card): per second
  train   ROUNDS STEPS        a small transformer's training steps through PyTorch: seconds per step
  touch   BLOCK_MIB TOTAL_MIB [hold]  allocate TOTAL_MIB in BLOCK_MIB tensors through PyTorch,
                              fill block i with int32s of value i + 1 and sum them all back:
                              the seconds it took and the checksum; with hold, wait for the kit
                              after its ``holding`` event (virtual device memory: past the
                              resident part the shim serves the blocks as managed memory)

The rate roles emit ``context`` once their CUDA context exists and ``ready`` after WARMUP
seconds; with ``sync`` they then keep working, unmeasured, until a line ``go`` (or the end)
arrives on stdin, so that two of them measure the same seconds.

API: driver (the CUDA driver API through ctypes: what any program ends up calling), torch
(PyTorch's caching allocator), torch-async (PyTorch on cudaMallocAsync, the stream-ordered
pools), cupy, or vmm (cuMemCreate, virtual memory management).  Only the standard library is
needed for the driver-API roles; the others import PyTorch or CuPy and say so when they cannot.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

MiB = 1 << 20
CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
MEM_ALLOCATION_TYPE_PINNED = 1
MEM_LOCATION_TYPE_DEVICE = 1


def emit(**fields: Any) -> None:
    print("@@tessera " + json.dumps(fields), flush=True)


def finish(**result: Any) -> None:
    emit(result=result)


def wait_for_kit() -> None:
    """Hold what this process has until the kit closes our stdin (or kills us)."""
    sys.stdin.read()


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class MemAllocationProp(ctypes.Structure):
    """CUmemAllocationProp (cuda.h): 32 bytes."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class Driver:
    """The CUDA driver API through ctypes, on device 0 of the container (its primary context)."""

    def __init__(self) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.check(self.cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.check(self.cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.dev = dev.value
        ctx = ctypes.c_void_p()
        self.check(
            self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.dev),
            "cuDevicePrimaryCtxRetain",
        )
        self.check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    @staticmethod
    def check(code: int, what: str) -> None:
        if code != CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed with CUDA error {code}")

    def mem_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check(
            self.cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo_v2"
        )
        return free.value, total.value

    def total_mem(self) -> int:
        total = ctypes.c_size_t()
        self.check(
            self.cu.cuDeviceTotalMem_v2(ctypes.byref(total), self.dev), "cuDeviceTotalMem_v2"
        )
        return total.value

    def alloc(self, nbytes: int) -> tuple[int, int]:
        ptr = ctypes.c_uint64()
        code = self.cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return code, ptr.value

    def vmm_prop(self) -> MemAllocationProp:
        prop = MemAllocationProp()
        prop.type = MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.dev
        return prop

    def vmm_granularity(self) -> int:
        g = ctypes.c_size_t()
        prop = self.vmm_prop()
        self.check(
            self.cu.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), 0),
            "granularity",
        )
        return g.value

    def vmm_create(self, nbytes: int) -> tuple[int, int]:
        handle = ctypes.c_uint64()
        prop = self.vmm_prop()
        code = self.cu.cuMemCreate(
            ctypes.byref(handle), ctypes.c_size_t(nbytes), ctypes.byref(prop), ctypes.c_ulonglong(0)
        )
        return code, handle.value

    def launch(self) -> int:
        code: int = self.cu.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        return code

    def synchronize(self) -> None:
        self.check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")


def import_torch(allocator: str = "native") -> Any:
    # The allocator is chosen once, at PyTorch's first CUDA allocation, from this variable.
    if allocator == "async":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("PyTorch sees no CUDA device")
    return torch


def torch_versions(torch: Any) -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "allocator": torch.cuda.get_allocator_backend()
        if hasattr(torch.cuda, "get_allocator_backend")
        else "?",
    }


def import_cupy() -> Any:
    import cupy

    return cupy


# ---- roles --------------------------------------------------------------------------------


def role_report(api: str) -> None:
    if api == "torch":
        torch = import_torch()
        free, total = torch.cuda.mem_get_info(0)
        props = torch.cuda.get_device_properties(0)
        finish(free=free, total=total, props_total=props.total_memory, **torch_versions(torch))
    else:
        drv = Driver()
        free, total = drv.mem_info()
        finish(free=free, total=total, props_total=drv.total_mem())


def fill_with(
    allocate: Callable[[], bool],
    block: int,
    cap: int,
    view: Callable[[], tuple[int, int]],
    **about: Any,
) -> None:
    held = 0
    oom = False
    while held < cap:
        if not allocate():
            oom = True
            break
        held += block
    free, total = view()
    emit(event="holding", allocated=held, oom=oom, free=free, total=total, **about)
    wait_for_kit()
    finish(allocated=held, oom=oom)


def role_fill(api: str, block_mib: int, cap_mib: int) -> None:
    block, cap = block_mib * MiB, cap_mib * MiB
    keep: list[Any] = []
    if api in ("torch", "torch-async"):
        torch = import_torch("async" if api == "torch-async" else "native")
        oom_error = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

        def torch_alloc() -> bool:
            try:
                keep.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
            except oom_error:
                return False
            return True

        fill_with(
            torch_alloc, block, cap, lambda: torch.cuda.mem_get_info(0), **torch_versions(torch)
        )
    elif api == "cupy":
        cupy = import_cupy()

        def cupy_alloc() -> bool:
            try:
                keep.append(cupy.empty((block,), dtype=cupy.uint8))
            except cupy.cuda.memory.OutOfMemoryError:
                return False
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                # Where CuPy allocates without its pool, the runtime's
                # cudaErrorMemoryAllocation (2) arrives as it is.
                if getattr(exc, "status", None) != 2:
                    raise
                return False
            return True

        fill_with(cupy_alloc, block, cap, cupy.cuda.runtime.memGetInfo)
    else:
        drv = Driver()
        if api == "vmm":
            g = drv.vmm_granularity()
            block = (block + g - 1) // g * g
            create = drv.vmm_create
        else:
            create = drv.alloc

        def driver_alloc() -> bool:
            code, handle = create(block)
            if code == CUDA_ERROR_OUT_OF_MEMORY:
                return False
            Driver.check(code, "allocation")
            keep.append(handle)
            return True

        fill_with(driver_alloc, block, cap, drv.mem_info)


def role_hold(mib: int) -> None:
    drv = Driver()
    code, _ = drv.alloc(mib * MiB)
    free, total = drv.mem_info()
    emit(event="holding", ok=code == CUDA_SUCCESS, code=code, free=free, total=total)
    wait_for_kit()
    finish(ok=code == CUDA_SUCCESS)


def alloc_size(spec: str, free: int) -> int:
    """Bytes for an alloc SIZE: MiB, or relative to what is free."""
    if spec == "free/2":
        return free // 2
    if spec.startswith(("free+", "free-")):
        delta = int(spec[5:]) * MiB
        return free + delta if spec[4] == "+" else max(free - delta, MiB)
    return int(spec) * MiB


def role_touch(block_mib: int, total_mib: int, hold: bool) -> None:
    torch = import_torch()
    oom_error = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    blocks, n = total_mib // block_mib, block_mib * MiB // 4
    keep: list[Any] = []
    started = time.perf_counter()
    try:
        for i in range(blocks):
            t = torch.empty(n, dtype=torch.int32, device="cuda")
            t.fill_(i + 1)
            keep.append(t)
    except oom_error as exc:
        emit(event="holding", ok=False, allocated_mib=len(keep) * block_mib, error=str(exc))
        if hold:
            wait_for_kit()
        finish(ok=False, allocated_mib=len(keep) * block_mib)
        return
    torch.cuda.synchronize()
    filled = time.perf_counter()
    # Summing reads every page again: what the driver moved to host memory comes back.
    checksum = sum(int(t.sum(dtype=torch.int64).item()) for t in keep)
    done = time.perf_counter()
    result = {
        "ok": True,
        "allocated_mib": blocks * block_mib,
        "checksum": checksum,
        "fill_s": filled - started,
        "sum_s": done - filled,
        "seconds": done - started,
        **torch_versions(torch),
    }
    emit(event="holding", **result)
    if hold:
        wait_for_kit()
    finish(**result)


def role_alloc(spec: str) -> None:
    drv = Driver()
    free, _ = drv.mem_info()
    size = alloc_size(spec, free)
    code, _ = drv.alloc(size)
    finish(ok=code == CUDA_SUCCESS, code=code, free_before=free, asked=size)


def go_signal() -> threading.Event:
    """Set when the kit writes ``go`` on stdin, or closes it."""
    go = threading.Event()

    def wait() -> None:
        for line in sys.stdin:
            if line.strip() == "go":
                break
        go.set()

    threading.Thread(target=wait, daemon=True).start()
    return go


def timed_rate(
    step: Callable[[], int], seconds: float, warmup: float, sync: bool
) -> tuple[float, list[float]]:
    """Units of work per second over `seconds`, after `warmup` seconds (the limiter settles in
    that time) and, with `sync`, after the kit says go; and the rate of each half second, so a
    limiter still settling shows in the results."""
    go = go_signal() if sync else None
    end_warmup = time.monotonic() + warmup
    while time.monotonic() < end_warmup:
        step()
    emit(event="ready")
    while go is not None and not go.is_set():
        step()  # keep the card as busy as when measured: the other side may still be warming up
    done, start = 0, time.monotonic()
    series: list[float] = []
    mark, mark_done, now = start, 0, start
    while now - start < seconds:
        done += step()
        now = time.monotonic()
        if now - mark >= 0.5:
            series.append(round((done - mark_done) / (now - mark), 1))
            mark, mark_done = now, done
    return done / (now - start), series


def role_matmul(seconds: float, warmup: float, sync: bool) -> None:
    torch = import_torch()
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    emit(event="context")

    def step() -> int:
        for _ in range(4):
            torch.matmul(a, b)
        torch.cuda.synchronize()
        return 4

    rate, series = timed_rate(step, seconds, warmup, sync)
    finish(rate=rate, series=series, unit="matmul/s", **torch_versions(torch))


def role_launch(seconds: float, warmup: float, sync: bool) -> None:
    drv = Driver()
    emit(event="context")

    def step() -> int:
        for _ in range(4):
            Driver.check(drv.launch(), "cuLaunchKernel")
        drv.synchronize()
        return 4

    rate, series = timed_rate(step, seconds, warmup, sync)
    finish(rate=rate, series=series, unit="kernels/s")


def role_train(rounds: int, steps: int) -> None:
    """A small transformer built here, on random data: the median seconds per step of each round."""
    torch = import_torch()
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=512, nhead=8, dim_feedforward=2048, batch_first=True
    )
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, num_layers=6), torch.nn.Linear(512, 512)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, 256, 512, device="cuda")
    y = torch.randn(32, 256, 512, device="cuda")

    def one_step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(10):
        one_step()
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            one_step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        per_round.append(times[len(times) // 2])
    finish(step_s=per_round)


def main(argv: list[str]) -> int:
    roles: dict[str, Callable[..., None]] = {
        "report": lambda api: role_report(api),
        "fill": lambda api, block, cap: role_fill(api, int(block), int(cap)),
        "hold": lambda mib: role_hold(int(mib)),
        "alloc": lambda spec: role_alloc(spec),
        "matmul": lambda seconds, warmup, *sync: role_matmul(
            float(seconds), float(warmup), sync == ("sync",)
        ),
        "launch": lambda seconds, warmup, *sync: role_launch(
            float(seconds), float(warmup), sync == ("sync",)
        ),
        "train": lambda rounds, steps: role_train(int(rounds), int(steps)),
        "touch": lambda block, total, *hold: role_touch(int(block), int(total), hold == ("hold",)),
    }
    if len(argv) < 2 or argv[1] not in roles:
        print(f"usage: worker.py {{{'|'.join(roles)}}} ARGS...", file=sys.stderr)
        return 2
    try:
        roles[argv[1]](*argv[2:])
    except ImportError as exc:
        finish(error=f"cannot import {exc.name}: {exc}", missing=exc.name)
        return 3
    except Exception as exc:  # the kit reports it; a traceback goes to the log
        import traceback

        traceback.print_exc()
        finish(error=f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
