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
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from nodeplugin.allocation import MIG
from nodeplugin.cards import Card, Health
from nodeplugin.config import Settings
from nodeplugin.dra_claims import ClaimPreparer, ClaimStore, Published
from nodeplugin.dra_plugin import ClaimReader, DraServer, DraServicer
from nodeplugin.dra_publish import SliceApi, SlicePublisher
from nodeplugin.dra_slices import MigLayout, NodeVersions, build_slices
from nodeplugin.mig import Mig, MigError
from nodeplugin.writer import Writer

log = logging.getLogger(__name__)

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
        mig: Mig,
    ) -> None:
        self.s = settings
        self.versions = versions  # the driver's and CUDA's, published as attributes
        self.cards = tuple(cards)
        self.state = state
        self.mig = mig
        # The placements of each card in MIG mode whose MIG is on, read from NVML off the event
        # loop whenever the modes change; a MIG card not in it offers nothing yet.
        self.mig_layouts: dict[str, MigLayout] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.health_changed = health_changed
        # Set once the control plane's inventory answer has given the cards' modes: publishing
        # before would offer an exclusive or MIG card as shared for a moment, and a claim could
        # be allocated on that shape. Until then the slices a predecessor published stay.
        self._modes_known = asyncio.Event()
        # A checkpoint that cannot be read stops the plugin here, before the kubelet is served.
        self.store = ClaimStore(settings.state_dir)
        self.preparer = ClaimPreparer(writer, self.store, mig, settings.proc_root)
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
        return Published(self.s.node_name, self.cards, dict(modes), dict(self.mig_layouts))

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
            mig=self.mig_layouts,
        )

    def read_mig_layouts(self) -> dict[str, MigLayout]:
        """The layouts of the cards in MIG mode (NVML calls: a thread). A card's placements do
        not change while it stays in MIG mode, so one read is kept; one NVML cannot give yet
        (MIG pending a reset) is asked again on the next change."""
        modes, _ = self.state()
        out: dict[str, MigLayout] = {}
        for card in self.cards:
            if modes.get(card.uuid) != MIG:
                continue
            known = self.mig_layouts.get(card.uuid)
            try:
                layout = known if known is not None else self.mig.layout(card.uuid)
            except MigError as exc:
                log.error("%s; the card offers no MIG device until it can be read", exc)
                continue
            if layout is not None:
                out[card.uuid] = layout
        return out

    async def _refresh(self) -> None:
        self.mig_layouts = await asyncio.to_thread(self.read_mig_layouts)
        self.publisher.kick()

    def changed(self) -> None:
        """The cards' modes (or their MIG state) changed: read the MIG cards' placements, then
        publish the new shape."""
        task = asyncio.get_running_loop().create_task(self._refresh())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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

    async def _follow_mig(self, stopping: asyncio.Event) -> None:
        """A MIG card whose placements could not be read (MIG waiting for a GPU reset, NVML
        failing for a moment) is asked again every heartbeat, not only at the next change."""
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.s.heartbeat_s)
            modes, _ = self.state()
            if any(m == MIG and u not in self.mig_layouts for u, m in modes.items()):
                await self._refresh()

    async def run(self, stopping: asyncio.Event) -> None:
        """Until ``stopping``: keep the sockets served and the slices published."""
        tasks = [
            asyncio.create_task(self.server.watch(stopping, self.s.kubelet_poll_s)),
            asyncio.create_task(self._publish(stopping)),
            asyncio.create_task(self._follow_health(stopping)),
            asyncio.create_task(self._follow_mig(stopping)),
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
