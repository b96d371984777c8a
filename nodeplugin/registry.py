"""The cards this node advertises and their health, with change notification for ListAndWatch."""

from __future__ import annotations

import asyncio

from nodeplugin import ids
from nodeplugin.cards import Card, Health
from nodeplugin.pb import dp

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


def _fired(event: asyncio.Event) -> asyncio.Event:
    """Wake everyone waiting on ``event``; the next change gets the fresh event returned."""
    event.set()
    return asyncio.Event()


class Registry:
    """Owned by the event loop; the NVML thread reports through ``loop.call_soon_threadsafe``."""

    def __init__(self, cards: list[Card], slots: int) -> None:
        self.cards = {c.uuid: c for c in cards}
        self.slots = slots
        self.health = {c.uuid: Health(True) for c in cards}
        self._changed = asyncio.Event()
        self.version = 0
        # ListAndWatch streams the kubelet holds open: its device manager keeps exactly one per
        # registration, so none means the kubelet does not see these cards now, whatever it
        # was told last (it dropped the connection, or a plugin that is going took it along).
        self.streams = 0
        self._streams_changed = asyncio.Event()

    def set_health(self, uuid: str, health: Health) -> bool:
        if uuid not in self.cards or self.health.get(uuid) == health:
            return False
        self.health[uuid] = health
        self.version += 1
        self._changed = _fired(self._changed)
        return True

    def changed(self) -> asyncio.Event:
        """An event set at the next change (take it before reading the snapshot)."""
        return self._changed

    def stream_opened(self) -> None:
        self.streams += 1
        if self.streams == 1:
            self._streams_changed = _fired(self._streams_changed)

    def stream_closed(self) -> None:
        self.streams -= 1
        if self.streams == 0:
            self._streams_changed = _fired(self._streams_changed)

    def streams_changed(self) -> asyncio.Event:
        """An event set when the kubelet next goes from no stream to one, or back."""
        return self._streams_changed

    def card_order(self) -> dict[str, int]:
        return {u: c.index for u, c in self.cards.items()}

    def snapshot(self) -> dp.ListAndWatchResponse:
        devices = []
        for card in sorted(self.cards.values(), key=lambda c: c.index):
            state = HEALTHY if self.health[card.uuid].healthy else UNHEALTHY
            topology = (
                dp.TopologyInfo(nodes=[dp.NUMANode(ID=card.numa_node)])
                if card.numa_node is not None
                else None
            )
            for k in range(self.slots):
                devices.append(
                    dp.Device(ID=ids.make_id(card.uuid, k), health=state, topology=topology)
                )
        return dp.ListAndWatchResponse(devices=devices)
