"""Run ``python -m nodeplugin`` against the fakes, in a subprocess (so pynvml loads the fake
``libnvidia-ml.so.1`` through LD_LIBRARY_PATH)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.nodeplugin.harness.controlplane import FakeControlPlane
from tests.nodeplugin.harness.gpu import GpuNode
from tests.nodeplugin.harness.kubelet import FakeKubelet

REPO = Path(__file__).resolve().parents[3]
NODE = "gpu-node-1"
TOKEN = "node-token-gpu-node-1"


# Run in the plugin's own process just before it becomes the plugin: SIGTERM it if the test
# process dies first (Linux prctl PR_SET_PDEATHSIG, kept across execv). Not a preexec_fn: that
# runs Python in the forked child of a process whose gRPC threads (the fake kubelet) are busy,
# and gRPC's fork handlers then abort the child now and then before it ever runs the plugin.
_DIE_WITH_PARENT_THEN_EXEC = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'nodeplugin'])\n"
)


class PluginProcess:
    def __init__(
        self,
        root: Path,
        gpu: GpuNode,
        kubelet: FakeKubelet,
        plane: FakeControlPlane,
        log_name: str = "plugin.log",
        **extra: str,
    ) -> None:
        self.root = root
        self.log_path = root / log_name
        (root / "token").write_text(TOKEN + "\n")
        plane.add_token(TOKEN, NODE)
        self.cdi_dir = root / "cdi"
        self.state_dir = root / "state"
        self.region_dir = root / "regions"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")},
            **gpu.env(),
            "PYTHONPATH": str(REPO),
            "TESSERA_NODE_NAME": NODE,
            "TESSERA_DEVICE_PLUGIN_DIR": str(kubelet.plugin_dir),
            "TESSERA_POD_RESOURCES_SOCKET": str(kubelet.podres_socket),
            "TESSERA_CONTROLPLANE_URL": plane.url,
            "TESSERA_TOKEN_FILE": str(root / "token"),
            "TESSERA_CDI_DIR": str(self.cdi_dir),
            "TESSERA_STATE_DIR": str(self.state_dir),
            "TESSERA_REGION_DIR": str(self.region_dir),
            "TESSERA_DEV_ROOT": str(gpu.dev),
            "TESSERA_SHIM_LIBRARY": str(root / "libtessera.so"),
            "TESSERA_SLOTS": "4",
            "TESSERA_HEALTH_PROBE_S": "0.1",
            "TESSERA_HEALTH_RECOVERY_S": "0.5",
            "TESSERA_KUBELET_POLL_S": "0.05",
            "TESSERA_STOP_DRAIN_S": "0.1",
            "TESSERA_HEARTBEAT_S": "1",
            "TESSERA_PRESTART_TIMEOUT_S": "3",
            "TESSERA_HTTP_TIMEOUT_S": "1",
            "TESSERA_LOG_LEVEL": "debug",
            "TESSERA_METRICS_INTERVAL_S": "0.05",
            **extra,
        }
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DIE_WITH_PARENT_THEN_EXEC],
            cwd=REPO,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.log.close()
                raise AssertionError(f"plugin ignored SIGTERM:\n{self.text()}") from None
        self.log.close()
        return self.proc.returncode

    def wait_exit(self, timeout: float = 10) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.stop()
