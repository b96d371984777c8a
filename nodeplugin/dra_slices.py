"""The node's cards as ``resource.k8s.io/v1`` ResourceSlices (docs/dra.md), pure.

One pool per node, named after it. Shared and MPS cards are devices that allow multiple
allocations, each allocation consuming memory, compute and one slot under request policies that
say Tessera's slice rules; exclusive cards are devices one claim takes whole; a MIG card is one
device per profile placement, the placements consuming counters of the card's memory slices so
that overlapping ones are never allocated together. Counter sets must be in a slice of their
own, so a node with MIG cards publishes two slices.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nodeplugin.allocation import MIG, MODES, MPS, SHARED
from nodeplugin.cards import Card, Health

DRIVER = "gpu.tessera.io"
API_VERSION = "resource.k8s.io/v1"
# Capacity names; a claim's ``capacity.requests`` and the allocation's ``consumedCapacity``
# use the same keys.
MEMORY, COMPUTE, SLOTS = "memory", "compute", "slots"
UNHEALTHY_TAINT = f"{DRIVER}/unhealthy"
# The API's limits (k8s.io/api resource/v1 types.go).
MAX_ATTRIBUTE_STRING = 64
MAX_DEVICES = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64  # ResourceSliceMaxDevicesWithAdvancedFeatures
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
STANDARD_PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
STANDARD_NUMA_NODE = "resource.kubernetes.io/numaNode"


class SliceError(ValueError):
    """The node's cards cannot be published as asked (an API limit, a bad MIG layout)."""


@dataclass(frozen=True)
class NodeVersions:
    """The NVIDIA driver and CUDA versions as NVML reports them (``550.54.15``, ``12.4``)."""

    driver: str = ""
    cuda: str = ""


@dataclass(frozen=True)
class MigOffer:
    """One placement of a MIG profile on a card's memory slices, and the profile's memory."""

    profile: str  # NVIDIA's name, e.g. 3g.40gb
    start: int
    size: int
    memory_mib: int


@dataclass(frozen=True)
class MigLayout:
    """What NVML says a MIG card offers: its number of memory slices and every placement."""

    memory_slices: int
    offers: tuple[MigOffer, ...]


def card_device_name(card: Card) -> str:
    return f"gpu-{card.index}"


def mig_device_name(card: Card, offer: MigOffer) -> str:
    profile = re.sub(r"[^a-z0-9]+", "-", offer.profile.lower()).strip("-")
    return f"gpu-{card.index}-mig-{profile}-{offer.start}"


def counter_set_name(card: Card) -> str:
    return f"gpu-{card.index}-slices"


def slice_name(node: str, counters: bool = False, part: int = 0) -> str:
    """The name of one of the node's slices: the first of each kind keeps the plain name, a
    pool too large for one slice goes on in ``-2``, ``-3``, ..."""
    return f"{node}-{DRIVER}" + ("-counters" if counters else "") + (f"-{part + 1}" if part else "")


def semver(text: str) -> str | None:
    """NVML's dotted version as semver (``535.104.05`` → ``535.104.5``, ``12.4`` → ``12.4.0``):
    semver forbids leading zeros and wants three parts. None for anything else, which is then
    not published rather than refused by the API server."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    return ".".join(str(int(p)) for p in [*parts, "0", "0"][:3])


def _mib(n: int) -> str:
    return f"{n}Mi"


def _attributes(card: Card, mode: str, versions: NodeVersions) -> dict[str, dict[str, object]]:
    attrs: dict[str, dict[str, object]] = {
        "uuid": {"string": card.uuid},
        "model": {"string": card.model[:MAX_ATTRIBUTE_STRING]},
        "index": {"int": card.index},
        "mode": {"string": mode},
    }
    if card.pci_bus_id:
        attrs[STANDARD_PCI_BUS_ID] = {"string": card.pci_bus_id}
    if card.numa_node is not None:
        attrs[STANDARD_NUMA_NODE] = {"int": card.numa_node}
    for name, raw in (("driverVersion", versions.driver), ("cudaVersion", versions.cuda)):
        version = semver(raw)
        if version is not None:
            attrs[name] = {"version": version}
    return attrs


def shared_capacity(card: Card, slots: int) -> dict[str, dict[str, object]]:
    """Tessera's slice rules (docs/scheduling.md §1) as request policies: memory in whole MiB,
    the whole card when not asked; compute in whole percent, none when not asked; exactly one
    slot per allocation, so the scheduler's sum keeps the card at ``slots`` slices."""
    return {
        MEMORY: {
            "value": _mib(card.memory_mib),
            "requestPolicy": {
                "default": _mib(card.memory_mib),
                "validRange": {"min": "1Mi", "step": "1Mi"},
            },
        },
        COMPUTE: {
            "value": "100",
            "requestPolicy": {
                "default": "0",
                "validRange": {"min": "0", "max": "100", "step": "1"},
            },
        },
        SLOTS: {
            "value": str(slots),
            "requestPolicy": {"default": "1", "validValues": ["1"]},
        },
    }


def _taints(health: Health) -> list[dict[str, object]]:
    # NoSchedule: no new claim gets the card, running pods keep it (docs/dra.md, Health).
    return [] if health.healthy else [{"key": UNHEALTHY_TAINT, "effect": "NoSchedule"}]


def _card_device(
    card: Card, mode: str, health: Health, slots: int, versions: NodeVersions
) -> dict[str, object]:
    device: dict[str, object] = {
        "name": card_device_name(card),
        "attributes": _attributes(card, mode, versions),
    }
    if mode in (SHARED, MPS):
        device["allowMultipleAllocations"] = True
        device["capacity"] = shared_capacity(card, slots)
    else:
        device["capacity"] = {MEMORY: {"value": _mib(card.memory_mib)}, COMPUTE: {"value": "100"}}
    taints = _taints(health)
    if taints:
        device["taints"] = taints
    return device


def _check_layout(card: Card, layout: MigLayout) -> None:
    if not 1 <= layout.memory_slices <= MAX_COUNTERS_PER_SET:
        raise SliceError(
            f"card {card.uuid}: {layout.memory_slices} MIG memory slices; a counter set holds "
            f"1 to {MAX_COUNTERS_PER_SET}"
        )
    for o in layout.offers:
        if o.size < 1 or o.start < 0 or o.start + o.size > layout.memory_slices:
            raise SliceError(
                f"card {card.uuid}: MIG placement {o.profile} at {o.start}+{o.size} lies outside "
                f"its {layout.memory_slices} memory slices"
            )


def _mig_devices(
    card: Card, layout: MigLayout, health: Health, versions: NodeVersions
) -> list[dict[str, object]]:
    _check_layout(card, layout)
    out: list[dict[str, object]] = []
    for o in sorted(layout.offers, key=lambda o: (o.profile, o.start)):
        attrs = _attributes(card, MIG, versions)
        attrs["profile"] = {"string": o.profile}
        attrs["placementStart"] = {"int": o.start}
        attrs["placementSize"] = {"int": o.size}
        device: dict[str, object] = {
            "name": mig_device_name(card, o),
            "attributes": attrs,
            "capacity": {MEMORY: {"value": _mib(o.memory_mib)}},
            "consumesCounters": [
                {
                    "counterSet": counter_set_name(card),
                    "counters": {
                        f"memory-slice-{k}": {"value": "1"}
                        for k in range(o.start, o.start + o.size)
                    },
                }
            ],
        }
        taints = _taints(health)
        if taints:
            device["taints"] = taints
        out.append(device)
    return out


def _slice(
    node: str, generation: int, count: int, counters: bool, body: object, part: int = 0
) -> dict[str, object]:
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {"name": slice_name(node, counters, part)},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            ("sharedCounters" if counters else "devices"): body,
        },
    }


def build_slices(
    node: str,
    cards: Sequence[Card],
    *,
    modes: Mapping[str, str],
    health: Mapping[str, Health],
    slots: int,
    generation: int,
    versions: NodeVersions = NodeVersions(),
    mig: Mapping[str, MigLayout] | None = None,
) -> list[dict[str, object]]:
    """The node's pool at ``generation``: the devices slice, and the counters slice when a card
    is in MIG mode. A card the modes do not name is shared (as in the inventory answer); a MIG
    card whose layout NVML has not given (MIG not enabled yet) offers nothing until it has."""
    if slots < 1:
        raise SliceError(f"slots must be at least 1, got {slots}")
    devices: list[dict[str, object]] = []
    counter_sets: list[dict[str, object]] = []
    for card in sorted(cards, key=lambda c: c.index):
        mode = modes.get(card.uuid, SHARED)
        if mode not in MODES:
            raise SliceError(f"card {card.uuid}: unknown mode {mode!r}, expected one of {MODES}")
        state = health.get(card.uuid, Health(True))
        if mode == MIG:
            layout = (mig or {}).get(card.uuid)
            if layout is None:
                continue
            devices += _mig_devices(card, layout, state, versions)
            counter_sets.append(
                {
                    "name": counter_set_name(card),
                    "counters": {
                        f"memory-slice-{k}": {"value": "1"} for k in range(layout.memory_slices)
                    },
                }
            )
        else:
            devices.append(_card_device(card, mode, state, slots, versions))
    # A slice holds at most 64 devices when any uses taints or counters (128 otherwise) and 8
    # counter sets: a larger pool (8 cards in MIG mode offer 150 and more placements) goes on
    # in further slices of the same pool, which the scheduler reads as one.
    advanced = bool(counter_sets) or any("taints" in d for d in devices)
    per_slice = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if advanced else MAX_DEVICES
    device_parts = _parts(devices, per_slice) or [[]]
    counter_parts = _parts(counter_sets, MAX_COUNTER_SETS)
    count = len(device_parts) + len(counter_parts)
    slices = [
        _slice(node, generation, count, False, part, k) for k, part in enumerate(device_parts)
    ]
    slices += [
        _slice(node, generation, count, True, part, k) for k, part in enumerate(counter_parts)
    ]
    return slices


def _parts(items: list[dict[str, object]], size: int) -> list[list[dict[str, object]]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class Pool:
    """The node's pool over time: a new generation exactly when what it publishes changes (a
    card's health, mode, MIG layout), so consumers that keep the highest generation never mix
    an old slice with a new one, and an unchanged heartbeat writes nothing."""

    def __init__(self, generation: int = 0) -> None:
        self.generation = generation  # continue from what the API server holds after a restart
        self._last: list[dict[str, object]] | None = None

    def update(
        self, slices_at: Callable[[int], list[dict[str, object]]]
    ) -> list[dict[str, object]] | None:
        """The slices to publish, or None when nothing changed since the last call.
        ``slices_at(generation)`` builds the node's slices now (:func:`build_slices`)."""
        content = slices_at(0)
        if content == self._last:
            return None
        self._last = content
        self.generation += 1
        return slices_at(self.generation)
