"""MIG geometry of each GPU model: its profiles and where each may sit on the card.

Facts from NVIDIA's MIG user guide ("Supported MIG Profiles", and the placements `nvidia-smi
mig -lgipp` lists). A MIG-capable card has 8 memory slices (4 on the A30) and 7 compute slices
(4 on the A30); a GPU instance of a profile covers ``memory_slices`` consecutive memory slices
starting at one of the profile's allowed starts (NVML's ``nvmlGpuInstancePlacement_t``: start,
size). Two instances never share a memory slice, so a card's free room is a bitmask of memory
slices (bit i set: slice i is taken).

``memory_mib`` is the memory an instance of the profile really has, a little less than the
name's nominal gigabytes (a container's memory ask must fit what the instance has): for the
A100 the figures ``nvidia-smi mig -lgip`` prints; for the other models the guide gives only the
fraction of the card, and the figures here are that fraction of the usable memory, rounded
down. Check them against ``nvidia-smi mig -lgip`` on such a card before relying on an ask
that sits within a few hundred MiB of a profile's size.
"""

from __future__ import annotations

from dataclasses import dataclass


def placement_mask(start: int, size: int) -> int:
    """The memory slices an instance of ``size`` slices placed at ``start`` covers, as a bitmask
    (bit i: memory slice i). The one definition: profiles, ledger claims and snapshots use it."""
    return ((1 << size) - 1) << start


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU instance profile (NVIDIA's name, e.g. ``3g.40gb``) and its allowed starts."""

    name: str
    memory_mib: int
    compute_slices: int
    memory_slices: int  # the placement's size
    starts: tuple[int, ...]
    media: bool = False  # a "+me" profile: only asked by name, never picked for a memory ask

    def mask(self, start: int) -> int:
        """The memory slices an instance placed at ``start`` covers, as a bitmask."""
        return placement_mask(start, self.memory_slices)


@dataclass(frozen=True, slots=True)
class MigGeometry:
    """A model's MIG profiles, smallest memory first."""

    name: str  # a label for messages, e.g. "A100 80GB"
    memory_slices: int
    compute_slices: int
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile | None:
        """The profile called ``name`` (case-insensitive), None when the model has none."""
        wanted = name.lower()
        for p in self.profiles:
            if p.name == wanted:
                return p
        return None

    def compute_percent(self, profile: MigProfile) -> int:
        """The profile's share of the card's compute, as the ledger records it."""
        return 100 * profile.compute_slices // self.compute_slices

    @property
    def full(self) -> int:
        """Every memory slice of the card, as a bitmask."""
        return placement_mask(0, self.memory_slices)


def _eight(label: str, sizes: tuple[str, str, str, str, str], mib: tuple[int, ...]) -> MigGeometry:
    """The A100/H100/H200 family: 8 memory slices, 7 compute slices, the same placements.

    ``sizes`` are the gigabyte parts of the names of 1g, 1g double-memory (also 2g's), 3g (also
    4g's) and 7g, e.g. ("10", "20", "40", "80"); ``mib`` the memory of 1g, 1g double-memory,
    2g, 3g, 4g and 7g.
    """
    one, two, three, _, seven = sizes
    return MigGeometry(
        label,
        8,
        7,
        (
            MigProfile(f"1g.{one}gb", mib[0], 1, 1, (0, 1, 2, 3, 4, 5, 6)),
            MigProfile(f"1g.{one}gb+me", mib[0], 1, 1, (0, 1, 2, 3, 4, 5, 6), media=True),
            MigProfile(f"1g.{two}gb", mib[1], 1, 2, (0, 2, 4, 6)),
            MigProfile(f"2g.{two}gb", mib[2], 2, 2, (0, 2, 4)),
            MigProfile(f"3g.{three}gb", mib[3], 3, 4, (0, 4)),
            MigProfile(f"4g.{three}gb", mib[4], 4, 4, (0,)),
            MigProfile(f"7g.{seven}gb", mib[5], 7, 8, (0,)),
        ),
    )


A30 = MigGeometry(
    "A30 24GB",
    4,
    4,
    (
        MigProfile("1g.6gb", 5952, 1, 1, (0, 1, 2, 3)),
        MigProfile("1g.6gb+me", 5952, 1, 1, (0, 1, 2, 3), media=True),
        MigProfile("2g.12gb", 12032, 2, 2, (0, 2)),
        MigProfile("2g.12gb+me", 12032, 2, 2, (0, 2), media=True),
        MigProfile("4g.24gb", 24192, 4, 4, (0,)),
    ),
)
A100_40 = _eight("A100 40GB", ("5", "10", "20", "20", "40"),
                 (4864, 9856, 9856, 19968, 19968, 40192))  # fmt: skip
A100_80 = _eight("A100 80GB", ("10", "20", "40", "40", "80"),
                 (9728, 19968, 19968, 40192, 40192, 81152))  # fmt: skip
H100_80 = _eight("H100 80GB", ("10", "20", "40", "40", "80"),
                 (9984, 20096, 20096, 40448, 40448, 81152))  # fmt: skip
H100_94 = _eight("H100 94GB", ("12", "24", "47", "47", "94"),
                 (11008, 22912, 22912, 46080, 46080, 93184))  # fmt: skip
GH200_96 = _eight("H100 96GB (GH200)", ("12", "24", "48", "48", "96"),
                  (11264, 23296, 23296, 46848, 46848, 94464))  # fmt: skip
H200_141 = _eight("H200 141GB", ("18", "35", "71", "71", "141"),
                  (16640, 33536, 33536, 67328, 67328, 135424))  # fmt: skip

GEOMETRIES: tuple[MigGeometry, ...] = (A30, A100_40, A100_80, H100_80, H100_94, GH200_96, H200_141)


def geometry_for(model: str) -> MigGeometry | None:
    """The MIG geometry of a card model as NVML names it ("NVIDIA A100-SXM4-80GB", "NVIDIA
    H100 80GB HBM3", "NVIDIA H200"), None for a model without MIG or one this table lacks."""
    m = model.lower()
    if "a30" in m:
        return A30
    if "a100" in m:
        return A100_80 if "80gb" in m else A100_40
    if "gh200" in m:  # before "h200", which it contains
        # The GH200 with 144 GB of HBM3e has other profiles, which this table lacks.
        return None if "144g" in m else GH200_96
    if "h200" in m:
        return H200_141
    if "h100" in m:
        if "nvl" in m or "94gb" in m:
            return H100_94
        if "96gb" in m:
            return GH200_96
        return H100_80
    return None


def free_starts(profile: MigProfile, occupied: int) -> list[int]:
    """The starts where an instance of ``profile`` fits beside the ``occupied`` slices."""
    return [s for s in profile.starts if not occupied & profile.mask(s)]


def profile_for(geometry: MigGeometry, memory_mib: int) -> MigProfile | None:
    """The smallest profile whose memory holds ``memory_mib`` (ties: fewer compute slices,
    then fewer memory slices); "+me" profiles are left for pods that name them. None when
    even the largest is too small."""
    best: MigProfile | None = None
    for p in geometry.profiles:
        if p.media or p.memory_mib < memory_mib:
            continue
        key = (p.memory_mib, p.compute_slices, p.memory_slices)
        if best is None or key < (best.memory_mib, best.compute_slices, best.memory_slices):
            best = p
    return best


def _room_left(geometry: MigGeometry, occupied: int) -> tuple[int, ...]:
    """Free placements of each profile, largest profile first: what a choice should keep."""
    ranked = sorted(geometry.profiles, key=lambda p: (-p.memory_slices, -p.compute_slices))
    return tuple(len(free_starts(p, occupied)) for p in ranked)


def choose_start(geometry: MigGeometry, profile: MigProfile, occupied: int) -> int | None:
    """Where to place ``profile``: the free start that leaves the most placements of the
    largest profiles open (compared largest first), ties to the lowest start. None when no
    placement is free."""
    best: int | None = None
    best_room: tuple[int, ...] = ()
    for s in free_starts(profile, occupied):
        room = _room_left(geometry, occupied | profile.mask(s))
        if best is None or room > best_room:
            best, best_room = s, room
    return best


def free_slices(geometry: MigGeometry, occupied: int) -> int:
    """Memory slices no instance covers."""
    return geometry.memory_slices - (occupied & geometry.full).bit_count()
