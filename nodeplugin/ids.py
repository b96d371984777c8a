"""Virtual device IDs and the names derived from them (pure).

The plugin advertises ``slots`` IDs per card, ``<card uuid>::<k>`` with ``k`` in
``0..slots-1``. The kubelet hands IDs to Allocate and PreStartContainer in no particular order,
so everything derived from a set of IDs is derived from the sorted list.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

SEPARATOR = "::"
MAX_DEVICE_ID = 63  # the kubelet's limit on Device.ID
_NAME = re.compile(r"^alloc-[0-9a-f]{16}-[0-9a-f]{8}$")


class DeviceIdError(ValueError):
    """An ID the plugin never advertised, or a request that names one twice."""


@dataclass(frozen=True, order=True)
class DeviceId:
    uuid: str
    slot: int

    def __str__(self) -> str:
        return f"{self.uuid}{SEPARATOR}{self.slot}"


def make_id(uuid: str, slot: int) -> str:
    value = f"{uuid}{SEPARATOR}{slot}"
    if len(value) > MAX_DEVICE_ID:
        raise DeviceIdError(
            f"device ID {value!r} is longer than the kubelet's {MAX_DEVICE_ID} characters"
        )
    return value


def advertised_ids(uuids: Iterable[str], slots: int) -> list[str]:
    return [make_id(u, k) for u in uuids for k in range(slots)]


def parse_id(value: str, known: Collection[str], slots: int) -> DeviceId:
    uuid, sep, slot = value.rpartition(SEPARATOR)
    if not sep or not slot.isdigit() or uuid not in known or not 0 <= int(slot) < slots:
        raise DeviceIdError(
            f"unknown device ID {value!r}: this plugin advertises <card uuid>::<0..{slots - 1}> "
            f"for the cards {', '.join(sorted(known)) or '(none)'}"
        )
    return DeviceId(uuid, int(slot))


def parse_ids(values: Iterable[str], known: Collection[str], slots: int) -> list[DeviceId]:
    """Parse and sort; refuse unknown and repeated IDs (the message names them)."""
    values = list(values)
    if not values:
        raise DeviceIdError("the request names no device IDs")
    parsed = sorted(parse_id(v, known, slots) for v in values)
    for a, b in itertools.pairwise(parsed):
        if a == b:
            raise DeviceIdError(f"device ID {a} is named twice in one request")
    return parsed


def canonical(ids: Iterable[DeviceId | str]) -> list[str]:
    return sorted(str(i) for i in ids)


def ids_digest(ids: Iterable[DeviceId | str]) -> str:
    """16 hex characters naming a set of IDs (order does not matter)."""
    text = "\n".join(canonical(ids))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def allocation_name(digest: str, nonce: int) -> str:
    """The per-Allocate name: ``alloc-<digest of the sorted IDs>-<32-bit nonce>``."""
    return f"alloc-{digest}-{nonce & 0xFFFFFFFF:08x}"


def is_allocation_name(name: str) -> bool:
    return bool(_NAME.match(name))


def cards_of(ids: Iterable[DeviceId]) -> dict[str, int]:
    """Card UUID → how many of the IDs are on it."""
    counts: dict[str, int] = {}
    for i in ids:
        counts[i.uuid] = counts.get(i.uuid, 0) + 1
    return counts


def ids_by_card(values: Iterable[str], known: Collection[str], slots: int) -> dict[str, list[str]]:
    """Group advertised IDs by card, skipping (not failing on) IDs this plugin does not know."""
    out: dict[str, list[str]] = {}
    for v in values:
        try:
            d = parse_id(v, known, slots)
        except DeviceIdError:
            continue
        out.setdefault(d.uuid, []).append(v)
    for lst in out.values():
        lst.sort(key=lambda s: int(s.rpartition(SEPARATOR)[2]))
    return out


def choose_preferred(
    available: Iterable[str],
    must_include: Iterable[str],
    size: int,
    wanted_cards: Collection[str] | None,
    card_order: Mapping[str, int],
    known: Collection[str],
    slots: int,
) -> list[str]:
    """Pick ``size`` IDs for GetPreferredAllocation.

    With ``wanted_cards`` (the cards the control plane allocated to the container being
    admitted) one ID on each of those cards, keeping ``must_include`` IDs. Otherwise one ID per
    card, cards in ``card_order`` (index) order, so slices land on different cards as the
    control plane would place them. Always returns IDs from ``available`` or ``must_include``.
    """
    must = sorted(set(must_include))
    pool = ids_by_card(set(available) | set(must), known, slots)
    chosen: list[str] = list(must)
    used_cards = {m.rpartition(SEPARATOR)[0] for m in must}

    def take(card: str) -> None:
        if card in used_cards or len(chosen) >= size:
            return
        for candidate in pool.get(card, []):
            if candidate not in chosen:
                chosen.append(candidate)
                used_cards.add(card)
                return

    if wanted_cards:
        for card in sorted(wanted_cards, key=lambda c: card_order.get(c, 1 << 30)):
            take(card)
    for card in sorted(pool, key=lambda c: card_order.get(c, 1 << 30)):
        take(card)
    # Fewer cards than IDs asked for: fill from any card (the PreStart check still decides).
    for card in sorted(pool, key=lambda c: card_order.get(c, 1 << 30)):
        for candidate in pool[card]:
            if len(chosen) >= size:
                break
            if candidate not in chosen:
                chosen.append(candidate)
    return chosen[: max(size, len(must))]
