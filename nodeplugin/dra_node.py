"""The node plugin's DRA mode put together (``TESSERA_PLUGIN_MODE=dra``, docs/dra.md).

The plugin process keeps what both modes share (NVML discovery and health, the card modes from
the control plane's inventory answer, MPS, task priority, metrics); in DRA mode this serves the
kubelet instead of the device plugin: the DRA service and its registration, the node's
ResourceSlices kept in step with the cards' health and modes, and prepared claims checkpointed
under the state directory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from nodeplugin.cards import Card, Health
from nodeplugin.config import Settings
from nodeplugin.dra_claims import ClaimPreparer, ClaimStore, Published
from nodeplugin.dra_plugin import ClaimReader, DraServer, DraServicer
from nodeplugin.dra_publish import SliceApi, SlicePublisher
from nodeplugin.dra_slices import NodeVersions, build_slices
from nodeplugin.writer import Writer

# The cards' modes (by UUID; a card not named is shared) and their health, as the plugin
# knows them now.
NodeState = Callable[[], tuple[Mapping[str, str], Mapping[str, Health]]]


class DraApi(ClaimReader, SliceApi, Protocol):
    """The API server calls of DRA mode (:class:`~nodeplugin.kubeapi.KubeApi`)."""


class DraNode:
    def __init__(
        self,
        settings: Settings,
        kube: DraApi,
        writer: Writer,
        cards: Sequence[Card],
        state: NodeState,
        health_changed: Callable[[], asyncio.Event],
        versions: NodeVersions,
    ) -> None:
        self.s = settings
        self.versions = versions  # the driver's and CUDA's, published as attributes
        self.cards = tuple(cards)
        self.state = state
        self.health_changed = health_changed
        # Set once the control plane's inventory answer has given the cards' modes: publishing
        # before would offer an exclusive or MIG card as shared for a moment, and a claim could
        # be allocated on that shape. Until then the slices a predecessor published stay.
        self._modes_known = asyncio.Event()
        # A checkpoint that cannot be read stops the plugin here, before the kubelet is served.
        self.store = ClaimStore(settings.state_dir)
        self.preparer = ClaimPreparer(writer, self.store)
        self.servicer = DraServicer(kube, self.preparer, self.published)
        self.publisher = SlicePublisher(
            kube, settings.node_name, self.slices_at, resync_s=settings.heartbeat_s
        )
        self.server = DraServer(
            settings.dra_registry_dir,
            settings.dra_plugin_dir,
            self.servicer,
            # The kubelet deletes a driver's slices when its plugin was gone a while: put them
            # back as soon as it takes the driver again.
            on_registered=self.publisher.kick,
        )

    def published(self) -> Published:
        modes, _ = self.state()
        return Published(self.s.node_name, self.cards, dict(modes))

    def slices_at(self, generation: int) -> list[dict[str, object]]:
        modes, health = self.state()
        return build_slices(
            self.s.node_name,
            self.cards,
            modes=modes,
            health=health,
            slots=self.s.slots,
            generation=generation,
            versions=self.versions,
        )

    def changed(self) -> None:
        """The cards' modes changed: publish the new shape."""
        self.publisher.kick()

    def modes_known(self) -> None:
        """The control plane answered an inventory report: the cards' modes are known."""
        self._modes_known.set()

    async def start(self) -> None:
        await self.server.start()

    async def _publish(self, stopping: asyncio.Event) -> None:
        await self._modes_known.wait()
        await self.publisher.run(stopping)

    async def _follow_health(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            await self.health_changed().wait()
            self.publisher.kick()

    async def run(self, stopping: asyncio.Event) -> None:
        """Until ``stopping``: keep the sockets served and the slices published."""
        tasks = [
            asyncio.create_task(self.server.watch(stopping, self.s.kubelet_poll_s)),
            asyncio.create_task(self._publish(stopping)),
            asyncio.create_task(self._follow_health(stopping)),
        ]
        await stopping.wait()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    def successor_serves(self) -> bool:
        return self.server.successor_serves()

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace)
