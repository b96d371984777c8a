"""What the plugin knows about a physical card (pure data)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Card:
    uuid: str
    index: int
    model: str
    memory_mib: int
    minor: int
    numa_node: int | None = None


@dataclass(frozen=True)
class Health:
    healthy: bool
    reason: str = ""


def inventory_report(
    plugin_version: str, cards: list[Card], health: dict[str, Health]
) -> dict[str, object]:
    """The JSON body of ``PUT /api/v1/nodes/<name>/inventory`` (DESIGN §7), exactly."""
    return {
        "plugin_version": plugin_version,
        "cards": [
            {
                "uuid": c.uuid,
                "index": c.index,
                "model": c.model,
                "memory_mib": c.memory_mib,
                "numa_node": c.numa_node,
                "healthy": health.get(c.uuid, Health(True)).healthy,
                "health_reason": health.get(c.uuid, Health(True)).reason,
            }
            for c in sorted(cards, key=lambda c: c.index)
        ],
    }
