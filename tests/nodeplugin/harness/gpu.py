"""The fake NVML library and the per-test GPU node it simulates."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SOURCE = Path(__file__).with_name("fake_nvml.c")


def build_fake_nvml() -> Path:
    """Compile the fake with gcc, once per version of the source (shared by test processes
    through the temp dir); returns the dir holding ``libnvidia-ml.so.1`` (for LD_LIBRARY_PATH)."""
    key = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"tessera-fake-nvml-{key}"
    if (out / "libnvidia-ml.so.1").exists():
        return out
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise RuntimeError(
            "gcc is needed to build the fake libnvidia-ml.so.1 (apt-get install gcc)"
        )
    work = Path(tempfile.mkdtemp(prefix="tessera-fake-nvml-build-"))
    lib = work / "libnvidia-ml.so.1"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(lib), str(SOURCE)],
        check=True,
    )
    out.mkdir(exist_ok=True)
    os.replace(lib, out / "libnvidia-ml.so.1")  # atomic: concurrent builders never see half
    shutil.rmtree(work, ignore_errors=True)
    return out


@dataclass(frozen=True)
class FakeCard:
    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB"
    memory_mib: int = 81920
    minor: int = 0
    numa: int = 0
    bus_id: str = "00000000:07:00.0"
    mig: bool = False  # MIG capable (A100/H100 80GB geometry)


def cards(n: int, prefix: str = "GPU-0000", numa_split: bool = True) -> list[FakeCard]:
    return [
        FakeCard(
            uuid=f"{prefix}{i:04d}-aaaa-bbbb-cccc-{i:012d}",
            minor=i,
            numa=(i * 2 // n) if numa_split else 0,
            bus_id=f"00000000:{0x10 + i:02x}:00.0",
        )
        for i in range(n)
    ]


class GpuNode:
    """Files the fake library reads: the card list, lost markers, the XID event log."""

    def __init__(self, root: Path, card_list: list[FakeCard]) -> None:
        self.root = root
        self.cards = card_list
        self.lib_dir = build_fake_nvml()
        self.state = root / "nvml-state"
        (self.state / "lost").mkdir(parents=True, exist_ok=True)
        self.cards_file = root / "nvml-cards.txt"
        self.cards_file.write_text(
            "".join(
                f"{c.uuid}|{c.name}|{c.memory_mib}|{c.minor}|{c.numa}|{c.bus_id}"
                + ("|mig\n" if c.mig else "\n")
                for c in card_list
            )
        )
        (self.state / "events").touch()
        self.dev = root / "dev"
        self.dev.mkdir(exist_ok=True)
        for c in card_list:
            (self.dev / f"nvidia{c.minor}").touch()
        for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
            (self.dev / name).touch()

        self.proc = root / "proc"
        self._write_mig_minors()

    def _write_mig_minors(self) -> None:
        """The driver's /proc/driver/nvidia-caps/mig-minors: a minor for every capability a
        card could have (the driver writes the whole table at load), numbered as the driver
        does: config, monitor, then per GPU minor its GPU instances and their compute
        instances."""
        lines = ["config 1", "monitor 2"]
        minor = 3
        for c in self.cards:
            for gi in range(15):
                lines.append(f"gpu{c.minor}/gi{gi}/access {minor}")
                minor += 1
                for ci in range(8):
                    lines.append(f"gpu{c.minor}/gi{gi}/ci{ci}/access {minor}")
                    minor += 1
        path = self.proc / "driver" / "nvidia-caps" / "mig-minors"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")

    def mig_minor(self, gpu_minor: int, gi: int, ci: int | None = None) -> int:
        path = self.proc / "driver" / "nvidia-caps" / "mig-minors"
        want = f"gpu{gpu_minor}/gi{gi}/" + (f"ci{ci}/access" if ci is not None else "access")
        for line in path.read_text().splitlines():
            cap, _, minor = line.partition(" ")
            if cap == want:
                return int(minor)
        raise KeyError(want)

    # -- MIG state, as the fake library keeps it (fake_nvml.c) -----------------------------

    def mig_file(self, uuid: str) -> Path:
        return self.state / "mig" / uuid

    def mig_state(self, uuid: str) -> dict[str, Any]:
        """``{"mode": (current, pending), "gi": [(id, profile_id, start, size)], "ci": [...]}``"""
        out: dict[str, Any] = {"mode": (0, 0), "gi": [], "ci": []}
        try:
            text = self.mig_file(uuid).read_text()
        except FileNotFoundError:
            return out
        for line in text.splitlines():
            kind, *nums = line.split()
            values = tuple(int(n) for n in nums)
            if kind == "mode":
                out["mode"] = values
            else:
                out[kind].append(values)
        return out

    def set_mig_state(self, uuid: str, state: dict[str, Any]) -> None:
        lines = ["mode {} {}".format(*state["mode"])]
        lines += ["gi {} {} {} {}".format(*g) for g in state["gi"]]
        lines += ["ci {} {} {}".format(*c) for c in state["ci"]]
        self.mig_file(uuid).parent.mkdir(exist_ok=True)
        self.mig_file(uuid).write_text("\n".join(lines) + "\n")

    def mig_reset(self, uuid: str) -> None:
        """A GPU reset: the pending MIG mode becomes the current one."""
        st = self.mig_state(uuid)
        st["mode"] = (st["mode"][1], st["mode"][1])
        self.set_mig_state(uuid, st)

    def mig_needs_reset(self, on: bool = True) -> None:
        flag = self.state / "mig_reset_required"
        if on:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)

    def env(self) -> dict[str, str]:
        return {
            "LD_LIBRARY_PATH": str(self.lib_dir),
            "FAKE_NVML_CARDS": str(self.cards_file),
            "FAKE_NVML_STATE": str(self.state),
        }

    def xid(self, uuid: str, xid: int) -> None:
        with open(self.state / "events", "a") as f:
            f.write(f"{uuid} {xid}\n")
            f.flush()
            os.fsync(f.fileno())

    def set_figures(self, uuid: str, **values: int) -> None:
        """What the card's gauges read (fake_nvml.c: util, mem_util, temp, power_mw,
        mem_used_mib); the file is replaced whole, so a reader never sees half of it."""
        self._replace(
            self.state / "figures" / uuid, "".join(f"{k} {v}\n" for k, v in values.items())
        )

    def set_processes(self, uuid: str, samples: list[tuple[int, int, int]]) -> None:
        """The card's per-process utilisation samples: (host pid, SM %, memory %)."""
        self._replace(
            self.state / "procs" / uuid, "".join(f"{p} {sm} {mem}\n" for p, sm, mem in samples)
        )

    def fail(self, uuid: str, call: str, on: bool = True) -> None:
        """Make one query (util, temp, power, memory, procs or placements) on one card fail."""
        flag = self.state / "fail" / f"{uuid}.{call}"
        flag.parent.mkdir(exist_ok=True)
        if on:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)

    @staticmethod
    def _replace(path: Path, text: str) -> None:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)

    def lose(self, uuid: str) -> None:
        (self.state / "lost" / uuid).touch()

    def recover(self, uuid: str) -> None:
        (self.state / "lost" / uuid).unlink(missing_ok=True)
