#!/usr/bin/env python3
"""Tessera's proof kit: does a process stay inside its slice, as the card measures it?

    make -C shim gpu-check OUT=/some/folder          (on a machine with an NVIDIA GPU)
    python3 shim/gpucheck/kit.py --fake --out DIR    (anywhere: the same checks on the fake driver)

Builds the shim (with the pinned wheels' headers when they are there, else the machine's own
CUDA headers), then runs "containers" as processes with the shim preloaded and the
environment a node plugin gives a container, and checks them from outside through the
host's NVML.  Prints a table and writes ``results.json`` (and a log per process) to the
folder.  Only the standard library is used; PyTorch and CuPy are used where installed and
the checks that need them say SKIP, with the reason, where they are not.  Every process runs
under a timeout and the whole kit under a time budget (default 280 s).

Exit status: 0 when nothing failed, 1 when a check failed, 2 when the kit could not start.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import json
import os
import platform
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MiB = 1 << 20
SHIM_DIR = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().with_name("worker.py")
sys.path.insert(0, str(SHIM_DIR.parent))  # the node plugin's region reader, from this checkout

from nodeplugin import shared_region  # noqa: E402 - standard library only

# The shim's stated tolerance (shim/README.md, "What the card counts"): as NVML counts it, a
# container stays within its limit plus this.
TOLERANCE_MIB = 128
BLOCK_MIB = 64  # allocation size of the fill checks
COMPUTE_TARGET = 30  # percent: the single-container compute check
COMPUTE_BAND = (0.20, 0.40)  # its throughput against the unlimited run
SHARE_TARGETS = (30, 60)  # two containers on one card
SHARE_RATIO_BAND = (1.5, 2.7)  # the 60 % container's throughput over the 30 % one's
OVERHEAD_LIMIT = 0.01  # a training step may be at most 1 % slower with the shim
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# How long a process may take to answer.  A driver-API process is on the card within a second
# or two, one that imports PyTorch or CuPy within several (more from a cold disk).  Short enough
# that a process the shim hangs costs its check, not the whole budget.
DRIVER_TIMEOUT_S = 45.0
FRAMEWORK_TIMEOUT_S = 90.0
MIN_CUDA_VERSION = 12040  # the oldest cuda.h the shim is built against (CUDA 12.4)
# Settings that change how PyTorch or CuPy allocate: a machine's own would make the checks
# test something else, so the containers run without them (results.json says what was set).
ALLOCATOR_ENV = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_NO_CUDA_MEMORY_CACHING",
    "CUPY_GPU_MEMORY_LIMIT",
)
# Virtual device memory: an opted-in slice on a card with this factor (resident part = slice /
# factor), allocated and touched in blocks of this size through PyTorch.
OVERSUB_FACTOR = 1.5
OVERSUB_BLOCK_MIB = 256
# What a process's context and the driver's own memory take on today's cards, at most: the
# sizes of the oversubscription section leave this much per process (an allowance, not a figure
# the kit measures).
CONTEXT_ALLOWANCE_MIB = 1024
NVML_VALUE_NOT_AVAILABLE = (1 << 64) - 1
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3


# ---- pure helpers (tests/shim/test_gpu_check.py) -------------------------------------------


@dataclass
class Result:
    """One row of the table and one entry of results.json."""

    name: str
    status: str
    measured: str = ""
    expected: str = ""
    reason: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def header_candidates(
    env: Mapping[str, str], sys_path: Sequence[str], nvcc: str | None
) -> list[Path]:
    """Folders that may hold cuda.h / nvml.h on a machine with CUDA, in the order to try them:
    the toolkit named by CUDA_HOME / CUDA_PATH, the one nvcc belongs to, the usual install
    places, then the include folders of the nvidia-* Python packages PyTorch wheels bring."""
    roots: list[Path] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            roots.append(Path(env[var]))
    if nvcc:
        roots.append(Path(nvcc).resolve().parent.parent)
    if env.get("CONDA_PREFIX"):  # conda's cuda-* packages
        roots.append(Path(env["CONDA_PREFIX"]))
    roots += [Path("/usr/local/cuda"), *sorted(Path("/usr/local").glob("cuda-*"), reverse=True)]
    dirs: list[Path] = []
    for root in roots:
        dirs += [root / "include", *sorted(root.glob("targets/*/include"))]
    dirs.append(Path("/usr/include"))
    for entry in sys_path:
        if entry:
            dirs += sorted(
                Path(p) for p in glob.glob(os.path.join(entry, "nvidia", "*", "include"))
            )
    seen: set[Path] = set()
    unique = []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            unique.append(d)
    return unique


def header_version(path: Path, macro: str) -> int | None:
    """The number a header #defines as `macro` (CUDA_VERSION, NVML_API_VERSION), if any."""
    try:
        m = re.search(rf"^#define\s+{macro}\s+(\d+)", path.read_text(errors="replace"), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def find_headers(candidates: Iterable[Path]) -> tuple[Path, Path]:
    """The first cuda.h and the first nvml.h among the candidates (they may be apart).  A cuda.h
    older than the shim needs (an old distribution package in /usr/include, say) gives way to a
    later candidate that is new enough."""
    cands = list(candidates)
    cudas = [d / "cuda.h" for d in cands if (d / "cuda.h").is_file()]
    cuda = next(
        (h for h in cudas if (header_version(h, "CUDA_VERSION") or 0) >= MIN_CUDA_VERSION),
        cudas[0] if cudas else None,
    )
    nvml = next((d / "nvml.h" for d in cands if (d / "nvml.h").is_file()), None)
    if cuda is None or nvml is None:
        missing = " and ".join(n for n, p in (("cuda.h", cuda), ("nvml.h", nvml)) if p is None)
        raise FileNotFoundError(
            f"{missing} not found; looked in {', '.join(map(str, cands))}. Set CUDA_HOME to a "
            "CUDA toolkit, or put the shim's pinned wheels' headers in shim/.deps/include"
        )
    return cuda, nvml


def fill_bounds(slice_mib: int, block_mib: int, tolerance_mib: int) -> tuple[int, int]:
    """Where NVML's figure for a container may stand when it is refused its next block: the
    refusal comes when the charge plus a block would pass the slice, and the charge is the
    card's figure within the tolerance."""
    return (slice_mib - block_mib - tolerance_mib) * MiB, (slice_mib + tolerance_mib) * MiB


def within(value: float, lo: float, hi: float) -> bool:
    return lo <= value <= hi


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of nothing")
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def parse_smi_csv(text: str) -> tuple[int, int]:
    """``memory.total, memory.used`` from ``nvidia-smi --format=csv,noheader,nounits``, MiB.
    nvidia-smi may put a warning (an infoROM, a driver mismatch) on stdout before the figures:
    such lines are passed over, but there must be exactly one line of two numbers."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    rows = [ln for ln in lines if re.fullmatch(r"\d+\s*,\s*\d+", ln)]
    if len(rows) != 1:
        raise ValueError(
            f"expected one line 'total, used' in MiB from nvidia-smi, got {len(rows)} in {text!r}"
        )
    total, used = (int(p) for p in rows[0].split(","))
    return total, used


def overhead_verdict(
    step_s: Mapping[str, Sequence[float]], base: str, limit: float
) -> tuple[bool, dict[str, float]]:
    """Median seconds per step of every configuration, against the baseline's; ok when none is
    more than `limit` slower."""
    medians = {k: median(v) for k, v in step_s.items()}
    slower = {k: medians[k] / medians[base] - 1.0 for k in medians if k != base}
    return all(s <= limit for s in slower.values()), slower


def mps_client_env(slice_mib: int, threads_pct: int, pipe_dir: Path) -> dict[str, str]:
    """What the node plugin gives a container's mps slice at ordinal 0 (docs/nodeplugin.md,
    *MPS*): MPS's own limits, and no shim limits for the ordinal."""
    return {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={slice_mib}M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(threads_pct),
    }


def mig_verdict(mode: tuple[int, int] | None, root: bool, minors: bool) -> tuple[str, str, str]:
    """(status, measured, reason) of the MIG report.  It reports and never changes the card:
    turning MIG on needs a GPU reset and takes the card from every other check (and from
    whoever lent it), so what it says is whether the plugin could, not that it did."""
    if mode is None:
        return SKIP, "card without MIG", "nvmlDeviceGetMigMode: not supported"
    current, pending = ("on" if m == 1 else "off" for m in mode)
    state = f"MIG {current}" + (f", {pending} after a GPU reset" if pending != current else "")
    can = []
    if not root:
        can.append("not root (nvmlDeviceSetMigMode needs root)")
    if not minors:
        can.append("no /proc/driver/nvidia-caps/mig-minors (nvidia-caps not loaded)")
    reason = (
        "the node plugin could turn MIG on here (a GPU reset follows)"
        if not can
        else "the node plugin could not turn MIG on here: " + "; ".join(can)
    )
    return PASS, state, reason


@dataclass(frozen=True)
class OversubPlan:
    """The sizes of the oversubscription section on a card with `card_free_mib` MiB free.  A
    process outside Tessera (the ballast) holds what the two resident parts do not need, so the
    card fills and the opted-in slice's managed part has to go to host memory."""

    resident_mib: int  # the opted-in slice's resident part
    slice_mib: int  # its slice: the resident part times the factor, rounded up
    touch_mib: int  # what it allocates and touches: its slice less a context, in whole blocks
    neighbour_mib: int  # the neighbour's slice (no opt-in)
    neighbour_alloc_mib: int  # what the neighbour allocates: its slice less a context
    ballast_mib: int


def oversub_plan(
    card_free_mib: int,
    resident_mib: int,
    neighbour_mib: int,
    factor: float = OVERSUB_FACTOR,
    block_mib: int = OVERSUB_BLOCK_MIB,
) -> OversubPlan:
    """The section's sizes; ValueError saying why when the card or the settings cannot show it:
    the touched part must pass the resident part (else nothing spills), the same work must fit
    in the card beside the ballast (the slice that fits, for the slowdown), and the ballast
    must be a real allocation."""
    slice_mib = -(-resident_mib * round(factor * 100) // 100)
    touch = (slice_mib - CONTEXT_ALLOWANCE_MIB) // block_mib * block_mib
    if touch <= resident_mib:
        raise ValueError(
            f"a {slice_mib} MiB slice touches {touch} MiB, not past its {resident_mib} MiB "
            "resident part: raise --oversub-resident-mib"
        )
    if touch > resident_mib + neighbour_mib:
        raise ValueError(
            f"the same work ({touch} MiB) would not fit beside the ballast for the comparison: "
            "raise --slice-mib (the neighbour's slice)"
        )
    room = resident_mib + neighbour_mib + 2 * CONTEXT_ALLOWANCE_MIB
    ballast = card_free_mib - room
    if ballast < block_mib:
        raise ValueError(
            f"the card has {card_free_mib} MiB free; the section needs more than {room} MiB"
        )
    return OversubPlan(
        resident_mib,
        slice_mib,
        touch,
        neighbour_mib,
        neighbour_mib - CONTEXT_ALLOWANCE_MIB,
        ballast,
    )


def touch_checksum(block_mib: int, blocks: int) -> int:
    """What the touch role's checksum must be: block i holds int32s of value i + 1."""
    per_block = block_mib * MiB // 4
    return per_block * blocks * (blocks + 1) // 2


def format_table(results: Sequence[Result]) -> str:
    cols = ("check", "status", "measured", "expected", "reason")
    rows = [(r.name, r.status, r.measured, r.expected, r.reason) for r in results]
    widths = [
        max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)
    ]
    widths[-1] = len(cols[-1])  # the reason runs on
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()
    out = [line, "  ".join("-" * w for w in widths)]
    out += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(out)


def mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.0f} MiB"


# ---- NVML, from outside the containers ----------------------------------------------------


class NvmlProcess(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class NvmlMemory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class HostNvml:
    """The host's view of the card (no shim in this process): per-process memory, identity."""

    def __init__(self, library: str) -> None:
        self.ml = ctypes.CDLL(library)
        if self.ml.nvmlInit_v2() != 0:
            raise RuntimeError("nvmlInit_v2 failed")

    def handle(self, index: int) -> ctypes.c_void_p:
        h = ctypes.c_void_p()
        if self.ml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(h)) != 0:
            raise RuntimeError(f"NVML has no device {index}")
        return h

    def uuid(self, index: int) -> str:
        buf = ctypes.create_string_buffer(96)
        if self.ml.nvmlDeviceGetUUID(self.handle(index), buf, 96) != 0:
            raise RuntimeError(f"no UUID for NVML device {index}")
        return buf.value.decode()

    def name(self, index: int) -> str:
        buf = ctypes.create_string_buffer(96)
        return (
            buf.value.decode()
            if self.ml.nvmlDeviceGetName(self.handle(index), buf, 96) == 0
            else "?"
        )

    def memory(self, index: int) -> NvmlMemory:
        m = NvmlMemory()
        if self.ml.nvmlDeviceGetMemoryInfo(self.handle(index), ctypes.byref(m)) != 0:
            raise RuntimeError("nvmlDeviceGetMemoryInfo failed")
        return m

    def total(self, index: int) -> int:
        return int(self.memory(index).total)

    def free(self, index: int) -> int:
        return int(self.memory(index).free)

    def text(self, call: str, *args: Any) -> str:
        """A string NVML gives (driver version...); "?" where this driver lacks the call."""
        buf = ctypes.create_string_buffer(96)
        fn = getattr(self.ml, call, None)
        return buf.value.decode() if fn is not None and fn(*args, buf, 96) == 0 else "?"

    def number(self, call: str, *args: Any) -> int | None:
        value = ctypes.c_int()
        fn = getattr(self.ml, call, None)
        return value.value if fn is not None and fn(*args, ctypes.byref(value)) == 0 else None

    def mig_mode(self, index: int) -> tuple[int, int] | None:
        """(current, pending) MIG mode; None where the card or the driver has no MIG."""
        current, pending = ctypes.c_uint(), ctypes.c_uint()
        fn = getattr(self.ml, "nvmlDeviceGetMigMode", None)
        if fn is None:
            return None
        if fn(self.handle(index), ctypes.byref(current), ctypes.byref(pending)) != 0:
            return None
        return int(current.value), int(pending.value)

    def processes(self, index: int) -> dict[int, int]:
        """pid -> bytes NVML counts for it on the card (-1 where NVML does not know)."""
        n = ctypes.c_uint(256)
        procs = (NvmlProcess * 256)()
        if (
            self.ml.nvmlDeviceGetComputeRunningProcesses_v3(
                self.handle(index), ctypes.byref(n), procs
            )
            != 0
        ):
            raise RuntimeError("nvmlDeviceGetComputeRunningProcesses_v3 failed")
        return {
            int(p.pid): -1 if p.usedGpuMemory == NVML_VALUE_NOT_AVAILABLE else int(p.usedGpuMemory)
            for p in procs[: n.value]
        }


# ---- running container processes ----------------------------------------------------------


class Worker:
    """A running worker.py: its @@tessera lines arrive on a queue; stdout and stderr go to a log."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and worker.py
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):  # the log is closed once the kit gave up on us
                self.log.write(line)
            if line.startswith("@@tessera "):
                try:
                    self.lines.put(json.loads(line[len("@@tessera ") :]))
                except json.JSONDecodeError:
                    with contextlib.suppress(ValueError):
                        self.log.write("(the line above is not JSON)\n")
        self.lines.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def next(self, timeout: float) -> dict[str, Any]:
        """The next message; a timeout or an exit without one is an error naming the log."""
        try:
            msg = self.lines.get(timeout=max(timeout, 0.1))
        except queue.Empty:
            self.kill()
            raise TimeoutError(f"no answer within {timeout:.0f} s (log: {self.log.name})") from None
        if msg is None:
            self.proc.wait(timeout=5)
            raise RuntimeError(
                f"exited ({self.proc.returncode}) without an answer (log: {self.log.name})"
            )
        return msg

    def result(self, timeout: float) -> dict[str, Any]:
        while True:
            msg = self.next(timeout)
            if "result" in msg:
                res: dict[str, Any] = msg["result"]
                return res

    def go(self) -> None:
        """Tell a rate role waiting with ``sync`` to start measuring."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write("go\n")
                self.proc.stdin.flush()

    def release(self) -> None:
        """Close stdin: a holding worker lets go and exits."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process and reap it.  A CUDA process's exit waits for the driver to tear
        its context down (well under a second); one stuck in the driver past 10 s is left, said
        in the log, rather than stopping the kit."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ValueError):
                self.log.write(f"(kit: pid {self.proc.pid} still there 10 s after signal {sig})\n")

    def close(self) -> None:
        """Let go, and make sure the process is gone; never raises, so that one stuck process
        cannot keep the kit from its other checks and its table."""
        self.release()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self.reader.join(timeout=5)
        with contextlib.suppress(OSError):
            self.log.close()


class Skip(Exception):
    """A check that cannot run here, with the reason."""


class Kit:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.out = Path(opts.out).resolve()
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="tessera-gpu-check."))
        self.fake = bool(opts.fake)
        self.deadline = time.monotonic() + opts.budget_s
        self.results: list[Result] = []
        self.workers: list[Worker] = []
        self.nlog = 0
        self.python = opts.python or sys.executable
        self.lib = Path(opts.shim).resolve() if opts.shim else None
        self.gpu = opts.gpu
        self.uuid = ""
        self.nvml: HostNvml | None = None
        self.info: dict[str, Any] = {}
        self.unlimited_rate: float | None = None
        self.baseline: set[int] = set()  # pids on the card when the current check began
        self.own_pids: bool | None = None  # whether NVML lists our workers by our pids
        self.exclusive = False  # the card takes one process at a time
        # Seconds a compute run works before it is measured: the limiter looks at NVML every
        # 100 ms, but a card's per-process samples can come further apart than that.
        self.warmup_s: float = (
            float(opts.warmup_s) if opts.warmup_s is not None else 1.5 if self.fake else 4.0
        )

    # -- set-up --

    def python_path(self) -> list[str]:
        """sys.path of the containers' interpreter (where PyTorch's nvidia-* packages are),
        which --python may make another than this one."""
        if Path(self.python).resolve() == Path(sys.executable).resolve():
            return list(sys.path)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            proc = subprocess.run(  # noqa: S603 - the interpreter the user named
                [self.python, "-c", "import sys; print('\\n'.join(sys.path))"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            if proc.returncode == 0:
                return proc.stdout.splitlines() + list(sys.path)
        return list(sys.path)

    def build(self) -> Result:
        """The shim (and in fake mode the fake driver), with the best headers this machine has.
        On a GPU machine nothing is downloaded: the pinned wheels' headers when shim/.deps has
        them, else the machine's own, always through INC= so that make never reaches for pip."""
        if self.lib is not None:
            return Result("build", PASS, str(self.lib), reason="--shim given: not built")
        make = ["make", "-s", "-C", str(SHIM_DIR)]
        if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc"):
            make.append("CC=gcc")  # images with gcc but no cc alternative
        if self.fake:
            targets = ["build/libtessera.so"]
            targets += ["build/fake/libcuda.so.1", "build/fake/libnvidia-ml.so.1"]
            self.lib = SHIM_DIR / "build" / "libtessera.so"
            where = "the pinned wheels' headers (shim/.deps)"
            cmd = [*make, *targets, f"PYTHON={self.python}"]
            data: dict[str, Any] = {}
        else:
            deps = SHIM_DIR / ".deps" / "include"
            cuda_h, nvml_h = find_headers(
                [deps, *header_candidates(os.environ, self.python_path(), shutil.which("nvcc"))]
            )
            build = SHIM_DIR / "build" / "gpu"
            inc = build / "include"
            inc.mkdir(parents=True, exist_ok=True)
            for h in (cuda_h, nvml_h):
                link = inc / h.name
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(h.resolve())
            self.lib = build / "libtessera.so"
            data = {
                "cuda_h": str(cuda_h),
                "CUDA_VERSION": header_version(cuda_h, "CUDA_VERSION"),
                "nvml_h": str(nvml_h),
                "NVML_API_VERSION": header_version(nvml_h, "NVML_API_VERSION"),
            }
            origin = (
                "the pinned wheels' headers"
                if cuda_h.parent == nvml_h.parent == deps
                else "this machine's headers"
            )
            where = (
                f"{origin}: cuda.h (CUDA_VERSION {data['CUDA_VERSION']}) in {cuda_h.parent}, "
                f"nvml.h in {nvml_h.parent}"
            )
            # -B: whatever a build folder carried here was built from other sources or headers.
            # No -Werror: another compiler or header version may warn where ours did not, and
            # a warning must not cost the one run on the card (build.log keeps them).
            cmd = [*make, "-B", f"B={build}", f"INC={inc}", "WERROR=", str(self.lib)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)  # noqa: S603
        (self.logs / "build.log").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode != 0:
            return Result(
                "build",
                FAIL,
                reason=f"make failed (logs/build.log; {where}): {proc.stderr.strip()[-300:]}",
                data=data,
            )
        warnings = proc.stderr.count("warning:")
        if warnings:
            where += f"; {warnings} compiler warnings (logs/build.log)"
        return Result(
            "build", PASS, str(self.lib.relative_to(SHIM_DIR.parent)), reason=where, data=data
        )

    def open_nvml(self) -> None:
        if self.fake:
            os.environ["FAKE_GPU_STATE"] = str(self.work / "card")
            os.environ["FAKE_CUDA_MEM_MIB"] = str(self.opts.fake_card_mib)
            self.nvml = HostNvml(str(SHIM_DIR / "build" / "fake" / "libnvidia-ml.so.1"))
        else:
            self.nvml = HostNvml("libnvidia-ml.so.1")
        self.uuid = self.nvml.uuid(self.gpu)
        busy = self.nvml.processes(self.gpu)
        h = self.nvml.handle(self.gpu)
        compute_mode = self.nvml.number("nvmlDeviceGetComputeMode", h)
        self.exclusive = compute_mode == NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
        self.info = {
            "card": self.nvml.name(self.gpu),
            "uuid": self.uuid,
            "card_mib": self.nvml.total(self.gpu) // MiB,
            "driver": self.nvml.text("nvmlSystemGetDriverVersion"),
            "driver_cuda": self.nvml.number("nvmlSystemGetCudaDriverVersion_v2"),
            "compute_mode": compute_mode,
            "persistence_mode": self.nvml.number("nvmlDeviceGetPersistenceMode", h),
            "other_processes_at_start": len(busy),
            "python": f"{self.python} ({sys.version.split()[0]} runs the kit)",
            "machine": platform.node(),
            "log_level": self.opts.log_level,
            "cleared_from_the_containers": {
                k: os.environ[k] for k in ALLOCATOR_ENV if k in os.environ
            },
            "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING", "(unset: lazy)"),
        }

    # -- containers --

    def container(
        self,
        name: str,
        mem_mib: int | None = None,
        core_pct: int | None = None,
        preload: bool = True,
        log_level: str | None = None,
        resident_mib: int | None = None,
    ) -> dict[str, str]:
        """A container's environment, as the node plugin gives it (one card: ordinal 0)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("TESSERA_", "LD_PRELOAD")) and k not in ALLOCATOR_ENV
        }
        region_dir = self.work / name
        region_dir.mkdir(exist_ok=True)
        env.update(
            CUDA_VISIBLE_DEVICES=self.uuid,
            NVIDIA_VISIBLE_DEVICES=self.uuid,
            CUDA_DEVICE_ORDER="PCI_BUS_ID",
            TESSERA_SHARED_REGION=str(region_dir / "region"),
            TESSERA_LOG_LEVEL=log_level or self.opts.log_level,
            PYTHONUNBUFFERED="1",
        )
        if preload and not self.opts.no_preload:
            assert self.lib is not None
            env["LD_PRELOAD"] = str(self.lib)
        if mem_mib is not None:
            env["TESSERA_DEVICE_MEMORY_LIMIT_0"] = str(mem_mib)
        if core_pct is not None:
            env["TESSERA_DEVICE_CORE_LIMIT_0"] = str(core_pct)
        if resident_mib is not None:
            env["TESSERA_DEVICE_MEMORY_RESIDENT_0"] = str(resident_mib)
        if self.fake:
            fake = SHIM_DIR / "build" / "fake"
            env["LD_LIBRARY_PATH"] = os.pathsep.join(
                filter(None, [str(fake), env.get("LD_LIBRARY_PATH", "")])
            )
            env.update(
                FAKE_GPU_STATE=os.environ["FAKE_GPU_STATE"],
                FAKE_CUDA_MEM_MIB=str(self.opts.fake_card_mib),
                FAKE_CUDA_CTX_MIB="300",  # what a context takes, as on a large card
                FAKE_NVML_UTIL="model",
                FAKE_KERNEL_US="1000",
                FAKE_GPU_QUEUE="4",
            )
        return env

    def start(self, env: dict[str, str], role: str, *args: object) -> Worker:
        self.nlog += 1
        log = self.logs / f"{self.nlog:02d}-{role}.log"
        w = Worker([self.python, str(WORKER), role, *map(str, args)], env, log)
        self.workers.append(w)
        return w

    def left(self, want: float) -> float:
        """Seconds a step may take: `want`, or what remains of the budget (Skip when too little)."""
        remaining = self.deadline - time.monotonic()
        if remaining < min(want, 10.0):
            raise Skip(f"the kit's time budget ({self.opts.budget_s:.0f} s) is spent")
        return float(min(want, remaining))

    def outcome(self, w: Worker, timeout: float) -> dict[str, Any]:
        """The worker's result, once it has exited (so it holds nothing on the card any more)."""
        res = w.result(self.left(timeout))
        w.close()
        if "missing" in res:
            raise Skip(f"{res['missing']} is not installed for {self.python}")
        if "error" in res:
            raise RuntimeError(res["error"])
        return res

    def host_used(self, workers: Sequence[Worker]) -> int:
        """What NVML counts for these workers.  Where the kit runs in a pid namespace NVML
        answers with host pids the kit cannot know: then it is what every process that appeared
        on the card since the check began uses (checks run one at a time).  Which of the two
        is settled the first time a worker is on the card, and kept: later, when the workers
        may be gone, an absent pid says nothing about it."""
        assert self.nvml is not None
        procs = self.nvml.processes(self.gpu)
        pids = [w.pid for w in workers]
        if self.own_pids is None:
            if any(p in procs for p in pids):
                self.own_pids = True
            elif any(p not in self.baseline for p in procs):
                self.own_pids = False
            self.info["nvml_pids"] = (
                "not yet known"
                if self.own_pids is None
                else "the kit's own"
                if self.own_pids
                else "host pids (a pid namespace): new processes counted"
            )
        if self.own_pids:
            used = [procs[p] for p in pids if p in procs]
        else:
            used = [u for pid, u in procs.items() if pid not in self.baseline]
        if any(u < 0 for u in used):
            raise RuntimeError("NVML does not give this card's per-process memory (N/A)")
        return sum(used)

    def needs_real(self, what: str) -> None:
        if self.fake:
            raise Skip(f"{what} needs a real GPU; the fake driver runs only the driver-API checks")

    # -- checks --

    def until(self, w: Worker, event: str, timeout: float) -> dict[str, Any]:
        """Wait for the worker's `event`; a result first (it could not get there) is the
        check's Skip or error."""
        while True:
            msg = w.next(self.left(timeout))
            if "result" in msg:
                res = msg["result"]
                if "missing" in res:
                    raise Skip(f"{res['missing']} is not installed for {self.python}")
                raise RuntimeError(res.get("error", f"finished without {event}"))
            if msg.get("event") == event:
                return msg

    def needs_two_processes(self) -> None:
        if self.exclusive:
            raise Skip("the card is in EXCLUSIVE_PROCESS compute mode: one process at a time")

    def check_report(self, api: str) -> Result:
        if api != "driver":
            self.needs_real("PyTorch")
        s = self.opts.slice_mib * MiB
        res = self.outcome(
            self.start(self.container(f"report-{api}", self.opts.slice_mib), "report", api),
            FRAMEWORK_TIMEOUT_S if api == "torch" else DRIVER_TIMEOUT_S,
        )
        ok = res["total"] == s and res["props_total"] == s and 0 <= res["free"] <= s
        what = (
            f"torch.cuda.mem_get_info / device properties (torch {res.get('torch')}, "
            f"CUDA {res.get('torch_cuda')})"
            if api == "torch"
            else "cuMemGetInfo / cuDeviceTotalMem"
        )
        return Result(
            f"slice reported ({api})",
            PASS if ok else FAIL,
            f"total {mib(res['total'])}, properties {mib(res['props_total'])}, "
            f"free {mib(res['free'])}",
            f"{self.opts.slice_mib} MiB, free within it",
            what,
            res,
        )

    def check_fill(self, api: str) -> list[Result]:
        """Allocate until refused: refused at the slice, and the card agrees (host NVML)."""
        framework = api in ("torch", "torch-async", "cupy")
        if framework:
            self.needs_real("CuPy" if api == "cupy" else "PyTorch")
        cap = (
            self.opts.slice_mib + 2048
        )  # never fill a whole card when nothing holds the process back
        w = self.start(
            self.container(f"fill-{api}", self.opts.slice_mib), "fill", api, BLOCK_MIB, cap
        )
        msg = self.until(w, "holding", FRAMEWORK_TIMEOUT_S if framework else DRIVER_TIMEOUT_S)
        time.sleep(0.2)  # NVML's figure for the process, after its last allocation
        used = self.host_used([w])
        w.release()
        w.result(self.left(30))
        lo, hi = fill_bounds(self.opts.slice_mib, BLOCK_MIB, TOLERANCE_MIB)
        oom_ok = bool(msg["oom"]) and within(used, lo, hi)
        name = {
            "driver": "cuMemAlloc",
            "vmm": "cuMemCreate",
            "torch": "PyTorch",
            "torch-async": "PyTorch, cudaMallocAsync",
            "cupy": "CuPy",
        }[api]
        data: dict[str, Any] = {
            "allocated": msg["allocated"],
            "host_nvml_used": used,
            "oom": msg["oom"],
            "reported_free": msg["free"],
            "reported_total": msg["total"],
            **{k: msg[k] for k in ("torch", "torch_cuda", "allocator") if k in msg},
        }
        refused = Result(
            f"out of memory at the slice ({name})",
            PASS if oom_ok else FAIL,
            f"{'refused' if msg['oom'] else 'NOT refused'} after {mib(msg['allocated'])}; "
            f"card: {mib(used)}",
            f"refused; card {mib(lo)}..{mib(hi)}",
            "" if msg["oom"] else f"still admitted at {mib(cap * MiB)}",
            data,
        )
        host = Result(
            f"host NVML within slice + tolerance ({name})",
            PASS if used <= hi else FAIL,
            mib(used),
            f"<= {self.opts.slice_mib} + {TOLERANCE_MIB} MiB",
            "the process as nvidia-smi on the host counts it",
            data,
        )
        return [refused, host]

    def check_nvidia_smi(self) -> Result:
        fake_smi = SHIM_DIR / "tests" / "fake" / "nvidia-smi"
        smi = self.opts.nvidia_smi or (str(fake_smi) if self.fake else shutil.which("nvidia-smi"))
        if smi is None:
            raise Skip("nvidia-smi is not on PATH")
        env = self.container("smi", self.opts.slice_mib)
        holder, msg = self.holding(env, 1024)
        charged = msg["total"] - msg["free"]
        argv = [
            smi,
            "--query-gpu=memory.total,memory.used",
            "--format=csv,noheader,nounits",
            f"--id={self.uuid}",
        ]
        proc = subprocess.run(  # noqa: S603 - the nvidia-smi on PATH or the one given
            argv, env=env, capture_output=True, text=True, timeout=self.left(30), check=False
        )
        (self.logs / "nvidia-smi.log").write_text(" ".join(argv) + "\n" + proc.stdout + proc.stderr)
        holder.close()
        if proc.returncode != 0:
            said = (proc.stderr or proc.stdout).strip()[-200:]
            raise RuntimeError(f"nvidia-smi failed ({proc.returncode}): {said}")
        total, used = parse_smi_csv(proc.stdout)
        ok = total == self.opts.slice_mib and abs(used - charged / MiB) <= 16
        return Result(
            "nvidia-smi inside reports the slice",
            PASS if ok else FAIL,
            f"total {total} MiB, used {used} MiB",
            f"total {self.opts.slice_mib} MiB, used ~{charged / MiB:.0f} MiB",
            "a process holding 1024 MiB",
            {"total_mib": total, "used_mib": used, "holder_charged": charged},
        )

    def holding(self, env: dict[str, str], mib_: int) -> tuple[Worker, dict[str, Any]]:
        """A process of the container that holds `mib_` MiB, and what it sees then."""
        w = self.start(env, "hold", mib_)
        msg = self.until(w, "holding", DRIVER_TIMEOUT_S)
        if not msg.get("ok"):
            raise RuntimeError(f"a process could not allocate {mib_} MiB: {msg}")
        return w, msg

    def check_two_processes(self) -> Result:
        """Two processes of one container share its slice: the second sees what the first left
        (its own context charged too), is refused more and admitted half of it."""
        self.needs_two_processes()
        s = self.opts.slice_mib
        env = self.container("shared", s)
        holder, _ = self.holding(env, s * 6 // 10)
        big = self.outcome(self.start(env, "alloc", f"free+{BLOCK_MIB}"), DRIVER_TIMEOUT_S)
        half = self.outcome(self.start(env, "alloc", "free/2"), DRIVER_TIMEOUT_S)
        holder.close()
        left = big["free_before"]
        ok = left <= s * MiB * 4 // 10 and not big["ok"] and half["ok"]
        return Result(
            "two processes share one slice",
            PASS if ok else FAIL,
            f"the second sees {mib(left)} free; more: {'admitted' if big['ok'] else 'refused'}, "
            f"half of it: {'admitted' if half['ok'] else 'refused'}",
            f"<= {s * 4 // 10} MiB free; refused; admitted",
            "while the first holds 60 %",
            {"more": big, "half": half},
        )

    def check_sigkill(self) -> Result:
        self.needs_two_processes()
        s = self.opts.slice_mib
        env = self.container("killed", s)
        holder, _ = self.holding(env, s * 8 // 10)
        held = self.host_used([holder])  # also settles how NVML names our processes
        before = self.outcome(self.start(env, "alloc", s * 8 // 10), DRIVER_TIMEOUT_S)
        holder.kill(signal.SIGKILL)
        # The driver frees a dead process's memory soon, not at once.
        gone, settle = self.host_used([holder]), time.monotonic() + 5.0
        while gone and time.monotonic() < settle:
            time.sleep(0.1)
            gone = self.host_used([holder])
        after = self.outcome(self.start(env, "alloc", f"free-{BLOCK_MIB}"), DRIVER_TIMEOUT_S)
        returned = after["free_before"] >= s * MiB * 7 // 10  # all but a new context's share
        ok = not before["ok"] and after["ok"] and returned and gone == 0
        return Result(
            "a SIGKILLed holder's memory returns",
            PASS if ok else FAIL,
            f"80 % while held: {'admitted' if before['ok'] else 'refused'}; after SIGKILL "
            f"{mib(after['free_before'])} free, {'admitted' if after['ok'] else 'refused'}; "
            f"card after: {mib(gone)}",
            f"refused; then >= {s * 7 // 10} MiB free, admitted; 0 MiB",
            f"the holder had {mib(held)} on the card",
            {"before": before, "after": after, "card_held": held, "card_after_kill": gone},
        )

    def compute_role(self) -> tuple[str, str]:
        return ("launch", "kernels/s") if self.fake else ("matmul", "matmul/s")

    def compute_timeout(self) -> float:
        """A rate process: start-up, its warm-up and its measured seconds."""
        return FRAMEWORK_TIMEOUT_S + self.warmup_s + float(self.opts.compute_s)

    def unlimited(self) -> float:
        if self.unlimited_rate is None:
            role, _ = self.compute_role()
            w = self.start(self.container("unlimited"), role, self.opts.compute_s, self.warmup_s)
            self.unlimited_rate = float(self.outcome(w, self.compute_timeout())["rate"])
        return self.unlimited_rate

    def check_compute(self) -> Result:
        role, unit = self.compute_role()
        base = self.unlimited()
        # debug: the logs then have the limiter's every step (utilisation seen, rate set)
        env = self.container("core30", core_pct=COMPUTE_TARGET, log_level="debug")
        res = self.outcome(
            self.start(env, role, self.opts.compute_s, self.warmup_s), self.compute_timeout()
        )
        share = float(res["rate"]) / base
        return Result(
            f"{COMPUTE_TARGET} % compute limit",
            PASS if within(share, *COMPUTE_BAND) else FAIL,
            f"{share:.0%} of unlimited ({res['rate']:.1f} vs {base:.1f} {unit})",
            f"{COMPUTE_BAND[0]:.0%}..{COMPUTE_BAND[1]:.0%}",
            "PyTorch bf16 matmul 8192²" if role == "matmul" else "",
            {"rate": res["rate"], "unlimited": base, "series": res.get("series")},
        )

    def check_share(self) -> Result:
        """Two containers at once.  The second starts once the first has its context: a shim
        in a pid namespace tells which NVML process it is by the pid that appeared across its
        own context creation, and two creations at the same instant would leave both unnamed
        (then each is held against the whole card's utilisation, which is another test).  Both
        measure the same seconds: each warms up, then waits, still working, for the go."""
        self.needs_two_processes()
        role, unit = self.compute_role()
        base = self.unlimited()
        a_pct, b_pct = SHARE_TARGETS
        args = (self.opts.compute_s, self.warmup_s, "sync")
        a = self.start(self.container("share-a", core_pct=a_pct, log_level="debug"), role, *args)
        self.until(a, "context", FRAMEWORK_TIMEOUT_S)
        b = self.start(self.container("share-b", core_pct=b_pct, log_level="debug"), role, *args)
        self.until(a, "ready", self.warmup_s + 30)
        self.until(b, "ready", self.compute_timeout())
        a.go()
        b.go()
        wait = self.opts.compute_s + 30
        res_a, res_b = self.outcome(a, wait), self.outcome(b, wait)
        ra, rb = float(res_a["rate"]), float(res_b["rate"])
        ratio = rb / ra if ra > 0 else float("inf")
        return Result(
            f"two containers at {a_pct} % and {b_pct} % share one card",
            PASS if within(ratio, *SHARE_RATIO_BAND) else FAIL,
            f"{ra / base:.0%} and {rb / base:.0%} of unlimited (ratio {ratio:.2f})",
            f"ratio {SHARE_RATIO_BAND[0]}..{SHARE_RATIO_BAND[1]}",
            f"{unit}, over the same seconds",
            {
                "a": ra,
                "b": rb,
                "unlimited": base,
                "series_a": res_a.get("series"),
                "series_b": res_b.get("series"),
            },
        )

    def check_overhead(self) -> Result:
        self.needs_real("the training loop (PyTorch)")
        configs = {
            "no shim": self.container("train-plain", preload=False),
            "shim, no limit": self.container("train-shim"),
            "shim, memory limit": self.container("train-mem", mem_mib=self.opts.train_slice_mib),
        }
        names = list(configs)
        step_s: dict[str, list[float]] = {k: [] for k in configs}
        for r in range(self.opts.overhead_rounds):
            # Side by side, and each round starts with another configuration: the card's clocks
            # and temperature drift over the check, and a fixed order would charge the drift to
            # whichever configuration always runs last.
            for name in names[r % len(names) :] + names[: r % len(names)]:
                res = self.outcome(self.start(configs[name], "train", 3, 15), FRAMEWORK_TIMEOUT_S)
                step_s[name] += res["step_s"]
        ok, slower = overhead_verdict(step_s, "no shim", OVERHEAD_LIMIT)
        base = median(step_s["no shim"])
        return Result(
            "overhead of a training loop",
            PASS if ok else FAIL,
            f"no shim {base * 1e3:.2f} ms/step; "
            + ", ".join(f"{k} {v:+.2%}" for k, v in slower.items()),
            f"<= +{OVERHEAD_LIMIT:.0%}",
            "median of the rounds' median step, runs interleaved",
            {"step_s": step_s, "slower": slower},
        )

    def check_oversubscription(self) -> list[Result]:
        """Virtual device memory on a full card: a 1.5x slice allocates and touches all of it
        (its plain part on the card, the rest served managed), its checksum is right and its
        region says it spilled; a neighbour without opt-in then still gets its whole slice; and
        the same work in a slice that fits gives the slowdown."""
        self.needs_real("touching memory past the card (PyTorch)")
        self.needs_two_processes()
        assert self.nvml is not None
        try:
            plan = oversub_plan(
                self.nvml.free(self.gpu) // MiB, self.opts.oversub_resident_mib, self.opts.slice_mib
            )
        except ValueError as exc:
            raise Skip(str(exc)) from None
        blocks = plan.touch_mib // OVERSUB_BLOCK_MIB
        expected = touch_checksum(OVERSUB_BLOCK_MIB, blocks)
        ballast, _ = self.holding(self.container("ballast", preload=False), plan.ballast_mib)
        try:
            fits = self.outcome(
                self.start(
                    self.container("oversub-fits", plan.slice_mib),
                    "touch", OVERSUB_BLOCK_MIB, plan.touch_mib,
                ),
                FRAMEWORK_TIMEOUT_S,
            )  # fmt: skip
            env = self.container("oversub", plan.slice_mib, resident_mib=plan.resident_mib)
            spiller = self.start(env, "touch", OVERSUB_BLOCK_MIB, plan.touch_mib, "hold")
            spilled = self.until(spiller, "holding", FRAMEWORK_TIMEOUT_S)
            region = shared_region.read_region(Path(env["TESSERA_SHARED_REGION"])).device(0)
            on_card = self.host_used([spiller])
            neighbour = self.outcome(
                self.start(
                    self.container("neighbour", plan.neighbour_mib),
                    "alloc", plan.neighbour_alloc_mib,
                ),
                DRIVER_TIMEOUT_S,
            )  # fmt: skip
            spiller.close()
        finally:
            ballast.close()
        spilled_b = region.spilled_bytes if region is not None else 0
        touched = bool(spilled.get("ok")) and spilled.get("checksum") == expected
        both = fits.get("ok") and spilled.get("ok")
        slowdown = spilled["seconds"] / fits["seconds"] if both else None
        data = {"plan": asdict(plan), "fits": fits, "spilled": spilled, "neighbour": neighbour,
                "region_spilled": spilled_b, "nvml_process_bytes": on_card}  # fmt: skip
        return [
            Result(
                "oversubscribed slice touched in full",
                PASS if touched and spilled_b > 0 else FAIL,
                f"{spilled.get('allocated_mib', 0)} MiB touched, checksum "
                f"{'right' if spilled.get('checksum') == expected else 'WRONG'}, "
                f"{mib(spilled_b)} served managed",
                f"{plan.touch_mib} MiB, checksum {expected}, > 0 MiB managed",
                f"slice {plan.slice_mib} MiB, resident {plan.resident_mib} MiB, the card filled "
                f"by a {plan.ballast_mib} MiB ballast; NVML counts {mib(on_card)} for it",
                data,
            ),
            Result(
                "a neighbour keeps its whole slice beside a spilled one",
                PASS if neighbour.get("ok") else FAIL,
                f"{plan.neighbour_alloc_mib} MiB: "
                f"{'admitted' if neighbour.get('ok') else 'refused'}",
                "admitted",
                f"slice {plan.neighbour_mib} MiB less a context, no opt-in, while the "
                "oversubscribed one holds everything",
                data,
            ),
            Result(
                "slowdown of a spilled slice",
                PASS if slowdown is not None and fits.get("checksum") == expected else FAIL,
                "not measured: a run failed"
                if slowdown is None
                else f"{slowdown:.2f}x ({spilled['seconds']:.2f} s against "
                f"{fits['seconds']:.2f} s in a slice that fits)",
                "(report only)",
                f"allocate, fill and sum {plan.touch_mib} MiB in {OVERSUB_BLOCK_MIB} MiB blocks",
                data,
            ),
        ]

    def check_mps(self) -> Result:
        """Two clients of one MPS daemon, each pinned to the slice with
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT as the node plugin does for an mps slice: each is
        refused at its slice while the other holds its own."""
        self.needs_real("MPS")
        self.needs_two_processes()
        control = shutil.which("nvidia-cuda-mps-control")
        if control is None:
            raise Skip("nvidia-cuda-mps-control is not on PATH")
        base = self.work / "mps"
        pipe, logs = base / "pipe", base / "log"
        pipe.mkdir(parents=True, exist_ok=True)
        logs.mkdir(parents=True, exist_ok=True)
        daemon_env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": self.uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(logs),
        }
        started = subprocess.run(  # noqa: S603 - NVIDIA's binary from PATH
            [control, "-d"], env=daemon_env, capture_output=True, text=True, timeout=30, check=False
        )
        pid_file = pipe / "nvidia-cuda-mps-control.pid"
        deadline = time.monotonic() + 10
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if started.returncode != 0 or not pid_file.exists():
            raise Skip(
                f"the MPS control daemon does not start here (exit {started.returncode}: "
                f"{(started.stderr or started.stdout).strip()[-200:]})"
            )
        try:
            s = self.opts.slice_mib
            cap = s + 2048
            clients = []
            for name in ("mps-a", "mps-b"):
                env = self.container(name)  # no shim limits: MPS holds the slice
                env.update(mps_client_env(s, 50, pipe))
                clients.append(self.start(env, "fill", "driver", BLOCK_MIB, cap))
            msgs = [self.until(w, "holding", DRIVER_TIMEOUT_S) for w in clients]
            for w in clients:
                w.release()
                w.result(self.left(30))
        finally:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(  # noqa: S603
                    [control], input="quit\n", env=daemon_env, text=True, timeout=30, check=False
                )
            (self.logs / "mps-control.log").write_text(
                "".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.log")))
            )
        # MPS counts a client's context against its pinned limit too, so only the upper bound
        # (the slice and the tolerance) is the check's.
        _, hi = fill_bounds(s, BLOCK_MIB, TOLERANCE_MIB)
        ok = all(m["oom"] and m["allocated"] <= hi for m in msgs)
        return Result(
            "MPS pinned memory limit holds for two clients",
            PASS if ok else FAIL,
            "; ".join(
                f"{'refused' if m['oom'] else 'NOT refused'} after {mib(m['allocated'])}"
                for m in msgs
            ),
            f"each refused at about {s} MiB",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=" + f"{s}M, no shim limits",
            {"clients": msgs, "most_bytes": hi},
        )

    def check_mig(self) -> Result:
        """Whether the node plugin could turn MIG on for this card: reported, never done."""
        self.needs_real("MIG")
        assert self.nvml is not None
        mode = self.nvml.mig_mode(self.gpu)
        minors = Path("/proc/driver/nvidia-caps/mig-minors").exists()
        status, measured, reason = mig_verdict(mode, os.geteuid() == 0, minors)
        return Result(
            "MIG can be turned on (report only)",
            status,
            measured,
            "a report: the card's MIG mode is left as it is",
            reason,
            {"mig_mode": mode, "root": os.geteuid() == 0, "mig_minors": minors},
        )

    # -- running --

    def checks(self) -> list[tuple[str, Callable[[], Result | list[Result]]]]:
        return [
            ("slice reported (driver)", lambda: self.check_report("driver")),
            ("slice reported (torch)", lambda: self.check_report("torch")),
            ("fill (driver)", lambda: self.check_fill("driver")),
            ("fill (torch)", lambda: self.check_fill("torch")),
            ("fill (torch-async)", lambda: self.check_fill("torch-async")),
            ("nvidia-smi inside reports the slice", self.check_nvidia_smi),
            ("two processes share one slice", self.check_two_processes),
            ("a SIGKILLed holder's memory returns", self.check_sigkill),
            ("fill (vmm)", lambda: self.check_fill("vmm")),
            ("fill (cupy)", lambda: self.check_fill("cupy")),
            (f"{COMPUTE_TARGET} % compute limit", self.check_compute),
            ("two containers share one card", self.check_share),
            ("oversubscribed slice", self.check_oversubscription),
            ("MPS pinned memory limit", self.check_mps),
            ("MIG can be turned on", self.check_mig),
            ("overhead of a training loop", self.check_overhead),  # the longest: last
        ]

    def record(self, results: Result | list[Result]) -> None:
        for r in results if isinstance(results, list) else [results]:
            self.results.append(r)
            print(
                f"{r.status:4}  {r.name}: {r.measured}{'  (' + r.reason + ')' if r.reason else ''}",
                flush=True,
            )
        self.write()

    def write(self) -> None:
        body = {
            "mode": "fake" if self.fake else "real",
            "slice_mib": self.opts.slice_mib,
            "tolerance_mib": TOLERANCE_MIB,
            "info": self.info,
            "elapsed_s": round(time.monotonic() - (self.deadline - self.opts.budget_s), 1),
            "checks": [asdict(r) for r in self.results],
        }
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(body, indent=2, default=str) + "\n")
        tmp.replace(self.out / "results.json")

    def run(self) -> int:
        try:
            built = self.build()
        except Exception as exc:  # no headers, no make, a timeout: said in results.json
            built = Result("build", FAIL, reason=f"{type(exc).__name__}: {exc}")
        self.record(built)
        if built.status != PASS:
            return 2
        try:
            self.open_nvml()
        except Exception as exc:
            self.record(
                Result(
                    "NVML on the host",
                    FAIL,
                    reason=f"{exc}: no NVIDIA driver here? (--fake runs without one)",
                )
            )
            return 2
        only = {s.strip() for s in self.opts.only.split(",")} if self.opts.only else None
        interrupted = False
        for name, check in self.checks():
            if only is not None and not any(o in name for o in only):
                continue
            t0 = time.monotonic()
            try:
                assert self.nvml is not None
                self.baseline = set(self.nvml.processes(self.gpu))
                results = check()
            except Skip as exc:
                results = Result(name, SKIP, reason=str(exc))
            except KeyboardInterrupt:  # SIGTERM too (main): stop, but leave the table
                results = Result(name, FAIL, reason="interrupted: the checks after it did not run")
                interrupted = True
            except Exception as exc:  # one check's failure must not stop the others
                results = Result(name, FAIL, reason=f"{type(exc).__name__}: {exc}")
            finally:
                for w in self.workers:
                    w.close()
                self.workers.clear()
            for r in results if isinstance(results, list) else [results]:
                r.seconds = round(time.monotonic() - t0, 1)
            self.record(results)
            if interrupted:
                break
        self.write()
        print()
        print(format_table(self.results))
        print(f"\nresults: {self.out / 'results.json'}  (logs in {self.logs})")
        shutil.rmtree(self.work, ignore_errors=True)
        return 1 if any(r.status == FAIL for r in self.results) else 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out",
        default=str(SHIM_DIR / "build" / "gpu-check"),
        help="folder for results.json and logs",
    )
    p.add_argument("--fake", action="store_true", help="run on the fake driver (no GPU needed)")
    p.add_argument("--gpu", type=int, default=0, help="NVML index of the card to use (default 0)")
    p.add_argument(
        "--slice-mib", type=int, default=4096, help="the memory slice under test (default 4096)"
    )
    p.add_argument(
        "--train-slice-mib", type=int, default=16384, help="memory limit of the overhead check"
    )
    p.add_argument(
        "--compute-s", type=float, default=4.0, help="seconds each compute run is measured"
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="seconds a compute run works before it is measured, while the limiter settles "
        "(default 4 on a GPU, 1.5 on the fake driver)",
    )
    p.add_argument("--overhead-rounds", type=int, default=3, help="rounds of the overhead check")
    p.add_argument("--budget-s", type=float, default=280.0, help="time budget for the whole kit")
    p.add_argument(
        "--only", default="", help="comma list: run only the checks whose names contain one"
    )
    p.add_argument("--shim", default="", help="use this libtessera.so instead of building one")
    p.add_argument(
        "--no-preload", action="store_true", help="run the containers without the shim (a control)"
    )
    p.add_argument(
        "--nvidia-smi", default="", help="the nvidia-smi to run inside (default: from PATH)"
    )
    p.add_argument(
        "--python", default="", help="interpreter for the container processes (default: this one)"
    )
    p.add_argument(
        "--log-level",
        default="info",
        help="TESSERA_LOG_LEVEL of the containers (default info: the logs then say which NVML "
        "process each one is and what it was refused; the compute-limited ones log at debug)",
    )
    p.add_argument("--fake-card-mib", type=int, default=16384, help="size of the fake card")
    p.add_argument(
        "--oversub-resident-mib",
        type=int,
        default=4096,
        help="resident part of the oversubscription section's opted-in slice (default 4096; "
        f"its slice is {OVERSUB_FACTOR}x that)",
    )
    opts = p.parse_args(argv)
    if opts.slice_mib < 1024 or opts.slice_mib % BLOCK_MIB:
        p.error(f"--slice-mib must be at least 1024 and a multiple of {BLOCK_MIB}")
    if opts.budget_s <= 0 or opts.compute_s <= 0 or opts.overhead_rounds < 1:
        p.error("--budget-s and --compute-s must be positive, --overhead-rounds at least 1")
    if opts.warmup_s is not None and opts.warmup_s < 0:
        p.error("--warmup-s must not be negative")
    if opts.oversub_resident_mib < 1:
        p.error("--oversub-resident-mib must be positive")
    return opts


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str]) -> int:
    # `timeout` sends SIGTERM: the running check's processes are then killed (they may hold
    # the card) and the table still printed.
    signal.signal(signal.SIGTERM, interrupt)
    return Kit(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
