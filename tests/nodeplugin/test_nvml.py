"""Discovery through real pynvml code against the fake libnvidia-ml.so.1 (in a subprocess, so
the library path applies), and the process's own errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.nodeplugin.harness.gpu import FakeCard, GpuNode
from tests.nodeplugin.harness.plugin import REPO

SCRIPT = """
import json
from nodeplugin.nvml import Nvml
n = Nvml()
print(json.dumps([c.__dict__ for c in n.discover()]))
print(json.dumps({u: n.probe(u) for u in n.handles}))
"""


def _run(gpu: GpuNode, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **gpu.env(), "PYTHONPATH": str(REPO), **env},
    )


def test_discovery_reads_every_field(tmp_path: Path) -> None:
    cards = [
        FakeCard("GPU-11111111-2222-3333-4444-555555555555", "NVIDIA H100 80GB HBM3", 81559, 2, 1),
        FakeCard(
            "GPU-66666666-2222-3333-4444-555555555555", "Tesla T4", 15360, 5, -1, "00000000:3b:00.0"
        ),
    ]
    gpu = GpuNode(tmp_path, cards)
    gpu.lose(cards[1].uuid)
    out = _run(gpu, SCRIPT)
    assert out.returncode == 0, out.stderr
    found, probes = (json.loads(line) for line in out.stdout.splitlines())
    assert found[0] == {
        "uuid": cards[0].uuid,
        "index": 0,
        "model": "NVIDIA H100 80GB HBM3",
        "memory_mib": 81559,
        "minor": 2,
        "numa_node": 1,
        "pci_bus_id": "00000000:07:00.0",
    }
    # a lost card at start cannot be read: it is left out (and logged), not guessed
    assert len(found) == 1
    assert probes == {cards[0].uuid: ""}
    gpu.recover(cards[1].uuid)
    found, _ = (json.loads(line) for line in _run(gpu, SCRIPT).stdout.splitlines())
    assert found[1]["numa_node"] is None and found[1]["minor"] == 5  # NVML could not tell
    assert found[1]["pci_bus_id"] == "00000000:3b:00.0"


def test_plugin_exits_clearly_without_a_driver(tmp_path: Path) -> None:
    gpu = GpuNode(tmp_path, [FakeCard("GPU-x")])
    (gpu.state / "init_fail").touch()
    out = _run(
        gpu,
        "from nodeplugin.__main__ import main; raise SystemExit(main())",
        TESSERA_NODE_NAME="n",
        TESSERA_CONTROLPLANE_URL="http://127.0.0.1:9",
    )
    assert out.returncode == 3
    assert "NVML cannot start" in out.stderr and "Driver Not Loaded" in out.stderr


def test_plugin_exits_clearly_on_bad_settings(tmp_path: Path) -> None:
    gpu = GpuNode(tmp_path, [FakeCard("GPU-x")])
    out = _run(
        gpu,
        "from nodeplugin.__main__ import main; raise SystemExit(main())",
        TESSERA_NODE_NAME="n",
        TESSERA_CONTROLPLANE_URL="http://127.0.0.1:9",
        TESSERA_SLOTS="-1",
    )
    assert out.returncode == 2
    assert "TESSERA_SLOTS=-1 is out of range" in out.stderr


def test_the_driver_and_cuda_versions_are_read_as_nvml_gives_them(tmp_path: Path) -> None:
    gpu = GpuNode(tmp_path, [FakeCard("GPU-x")])
    code = "from nodeplugin.nvml import Nvml\nprint(list(Nvml().versions()))"
    done = _run(gpu, code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.replace("'", '"')) == ["550.54.15", "12.4"]
