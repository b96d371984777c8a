"""The plugin's socket file belongs to the process that made it.

When a DaemonSet replaces the plugin's pod, the new plugin starts while the old one is still
terminating, and both use the same path in the kubelet's directory: the new one replaces the
file and registers. The old one's shutdown must then leave that file alone. It removed it,
seen with a real kubelet: the new plugin's server was cut off from the path, it served and
registered again, and a pod admitted in between was refused ("no healthy devices").
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from nodeplugin import config
from nodeplugin.app import Plugin
from nodeplugin.cards import Card


class NoCards:
    """NVML with no card: serving the socket needs none."""

    handles: dict[str, object] = {}

    def discover(self) -> list[Card]:
        return []


def settings(root: Path) -> config.Settings:
    (root / "token").write_text("t\n")
    return config.load(
        {
            "TESSERA_NODE_NAME": "node-1",
            "TESSERA_CONTROLPLANE_URL": "http://127.0.0.1:9",
            "TESSERA_TOKEN_FILE": str(root / "token"),
            "TESSERA_DEVICE_PLUGIN_DIR": str(root / "dp"),
            "TESSERA_POD_RESOURCES_SOCKET": str(root / "pr.sock"),
            "TESSERA_CDI_DIR": str(root / "cdi"),
            "TESSERA_STATE_DIR": str(root / "state"),
            "TESSERA_REGION_DIR": str(root / "regions"),
        }
    )


def test_stopping_leaves_a_successors_socket_and_removes_its_own(short_tmp: Path) -> None:
    s = settings(short_tmp)

    async def main() -> None:
        old = Plugin(s, nvml=NoCards())  # type: ignore[arg-type]
        await old.start_server()
        path = s.plugin_socket_path
        # The successor takes the path over, as its start_server does.
        path.unlink()
        successor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        successor.bind(str(path))
        theirs = path.stat().st_ino
        try:
            await old.stop_server(0)
            assert path.exists() and path.stat().st_ino == theirs
        finally:
            successor.close()
            path.unlink()

        alone = Plugin(s, nvml=NoCards())  # type: ignore[arg-type]
        await alone.start_server()
        assert path.exists()
        await alone.stop_server(0)
        assert not path.exists()  # its own socket it removes, as before

    asyncio.run(main())
