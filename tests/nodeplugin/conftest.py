"""Fixtures for the node plugin's tests: a whole fake node (GPU driver, kubelet, control plane)
around a real ``python -m nodeplugin`` process."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.nodeplugin.harness.controlplane import FakeControlPlane
from tests.nodeplugin.harness.gpu import FakeCard, GpuNode, cards
from tests.nodeplugin.harness.kubelet import FakeKubelet
from tests.nodeplugin.harness.plugin import PluginProcess

T = TypeVar("T")


@dataclass
class Node:
    root: Path
    gpu: GpuNode
    plane: FakeControlPlane
    kubelet: FakeKubelet
    plugin: PluginProcess

    @property
    def uuids(self) -> list[str]:
        return [c.uuid for c in self.gpu.cards]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """Unix socket paths must stay under 108 bytes: pytest's tmp_path can be too long."""
    path = Path(tempfile.mkdtemp(prefix="tnp-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def fake_node(
    root: Path, card_list: list[FakeCard] | None = None, **plugin_env: str
) -> AsyncIterator[Node]:
    gpu = GpuNode(root, card_list if card_list is not None else cards(4))
    plane = FakeControlPlane()
    kubelet = FakeKubelet(root / "k")
    await kubelet.start()
    plugin = PluginProcess(root, gpu, kubelet, plane, **plugin_env)
    node = Node(root, gpu, plane, kubelet, plugin)
    try:
        try:
            await kubelet.wait_registered()
        except TimeoutError:
            raise AssertionError(f"plugin did not register:\n{plugin.text()}") from None
        yield node
    finally:
        rc = node.plugin.stop()  # a test may have replaced the process
        if plugin is not node.plugin:
            plugin.stop()
        await kubelet.stop()
        plane.stop()
        assert rc == 0, f"plugin exited {rc} on SIGTERM:\n{node.plugin.text()}"


def run(fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(fn())


async def eventually(check: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.02)
