"""What the plugin knows about a physical card (pure data)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from nodeplugin.allocation import MODES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Card:
    uuid: str
    index: int
    model: str
    memory_mib: int
    minor: int
    numa_node: int | None = None
    pci_bus_id: str | None = None  # NVML's extended BDF, e.g. 00000000:3B:00.0


@dataclass(frozen=True)
class Health:
    healthy: bool
    reason: str = ""


def inventory_report(
    plugin_version: str,
    cards: list[Card],
    health: dict[str, Health],
    mig: Mapping[str, dict[str, object]] | None = None,
    memory: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """The JSON body of ``PUT /api/v1/nodes/<name>/inventory`` (DESIGN §7), exactly. ``mig``
    (docs/card-modes.md) goes on the cards that can do MIG only: a card without it is not
    MIG capable, and a control plane that predates MIG never meets the key. ``memory`` (from
    :func:`virtual_memory_fields`) goes at the top level."""
    out = []
    for c in sorted(cards, key=lambda c: c.index):
        card: dict[str, object] = {
            "uuid": c.uuid,
            "index": c.index,
            "model": c.model,
            "memory_mib": c.memory_mib,
            "numa_node": c.numa_node,
            "healthy": health.get(c.uuid, Health(True)).healthy,
            "health_reason": health.get(c.uuid, Health(True)).reason,
        }
        if mig and c.uuid in mig:
            card["mig"] = mig[c.uuid]
        out.append(card)
    return {"plugin_version": plugin_version, "cards": out, **(memory or {})}


# The inventory report's node-level keys of virtual device memory (docs/nodeplugin.md).
VIRTUAL_MEMORY_KEYS = ("memory_oversubscription", "spill_reserve_mib", "host_memory_mib")


def virtual_memory_fields(factor: str, reserve_mib: int, host_mib: int | None) -> dict[str, object]:
    """The node's default oversubscription factor, spill reserve and memory, as the report
    carries them; nothing for a node that leaves the feature off (factor "1", no reserve), so
    its report stays what it was and a control plane that predates the keys never meets them."""
    if factor == "1" and reserve_mib == 0:
        return {}
    out: dict[str, object] = {"memory_oversubscription": factor, "spill_reserve_mib": reserve_mib}
    if host_mib is not None:
        out["host_memory_mib"] = host_mib
    return out


def modes_from_answer(answer: Mapping[str, Any], uuids: Collection[str]) -> dict[str, str] | None:
    """The card modes in the inventory report's answer (docs/card-modes.md), for this node's
    cards; None when the answer has none (a control plane that predates card modes: nothing
    changes). A card it does not name is shared; a mode the plugin does not know is logged and
    the card treated as shared rather than guessed."""
    raw = answer.get("modes")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        log.error("inventory answer: modes must be an object of card UUID to mode, got %r", raw)
        return None
    out: dict[str, str] = {}
    for uuid, mode in raw.items():
        if uuid not in uuids:
            continue
        if mode not in MODES:
            log.error("inventory answer: modes[%s]=%r is not one of %s", uuid, mode, MODES)
            continue
        out[uuid] = mode
    return out
