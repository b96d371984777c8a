"""The cards this node advertises and their health, with change notification for ListAndWatch."""

from __future__ import annotations

import asyncio

from nodeplugin import ids
from nodeplugin.cards import Card, Health
from nodeplugin.pb import dp

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class Registry:
    """Owned by the event loop; the NVML thread reports through ``loop.call_soon_threadsafe``."""

    def __init__(self, cards: list[Card], slots: int) -> None:
        self.cards = {c.uuid: c for c in cards}
        self.slots = slots
        self.health = {c.uuid: Health(True) for c in cards}
        self._changed = asyncio.Event()
        self.version = 0

    def set_health(self, uuid: str, health: Health) -> bool:
        if uuid not in self.cards or self.health.get(uuid) == health:
            return False
        self.health[uuid] = health
        self.version += 1
        old, self._changed = self._changed, asyncio.Event()
        old.set()
        return True

    def changed(self) -> asyncio.Event:
        """An event set at the next change (take it before reading the snapshot)."""
        return self._changed

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
