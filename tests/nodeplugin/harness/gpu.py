"""The fake NVML library and the per-test GPU node it simulates."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

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
                f"{c.uuid}|{c.name}|{c.memory_mib}|{c.minor}|{c.numa}|{c.bus_id}\n"
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

    def lose(self, uuid: str) -> None:
        (self.state / "lost" / uuid).touch()

    def recover(self, uuid: str) -> None:
        (self.state / "lost" / uuid).unlink(missing_ok=True)
