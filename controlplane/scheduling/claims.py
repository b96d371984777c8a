"""What one pod holds on each card, with Kubernetes init-container semantics.

Init containers run one at a time before the app containers start, so a pod never needs
its init and app slices at the same moment. Sidecars (init containers with `restartPolicy:
Always`) start in order among the init containers and keep running beside every later init
container and the app containers. Like the kubelet's effective-request rule, the pod's claim
on a card is the larger of (its app containers and all its sidecars there) and, over its
ordinary init containers, (that container and the sidecars started before it there). Fit
uses exactly this rule, and the control plane sums ledger rows through it, so the two never
disagree on how much room a pod takes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from controlplane.scheduling.mig import placement_mask

#: A slice with this much compute (percent of the card) or more holds its card alone: no other
#: pod may share the card. The one definition of "exclusive": the fit, the plan, the claims and
#: the ledger's SQL (controlplane/ledger/usage.py) all compare against it.
EXCLUSIVE_CORES = 100


@dataclass(frozen=True, slots=True)
class SliceClaim:
    """One recorded slice (a row of the ledger)."""

    card_uuid: str
    container_index: int
    init: bool
    memory_mib: int
    cores: int
    sidecar: bool = False  # an init container that keeps running (restartPolicy: Always)
    mig_start: int = 0  # a MIG instance's placement on the card's memory slices
    mig_size: int = 0  # 0: not a MIG instance
    # The part that stays on the card (docs/virtual-memory.md); None: all of it.
    resident_mib: int | None = None

    @property
    def resident(self) -> int:
        """MiB of the slice that stay on the card."""
        return self.memory_mib if self.resident_mib is None else self.resident_mib

    @property
    def mig_mask(self) -> int:
        """The memory slices the slice's MIG instance covers (0 for other slices)."""
        return placement_mask(self.mig_start, self.mig_size)


@dataclass(frozen=True, slots=True)
class CardClaim:
    """The room one pod takes on one card.

    ``exclusive`` is True when any of the pod's slices there asks for 100% compute; no
    other pod may then share the card. ``mig_mask``: the memory slices its MIG instances
    there cover (init containers' too: an instance is the hardware's, held until the binding
    ends). ``resident_mib``: the part of ``memory_mib`` that stays on the card (None: all of
    it), ``spill_mib``: what the pod's slices there may spill to the host (both folded by the
    same rule as the memory; docs/virtual-memory.md).
    """

    memory_mib: int
    cores: int
    slots: int
    exclusive: bool
    mig_mask: int = 0
    resident_mib: int | None = None
    spill_mib: int = 0

    @property
    def resident(self) -> int:
        """MiB of the claim that stay on the card."""
        return self.memory_mib if self.resident_mib is None else self.resident_mib


def claims_per_card(slices: Iterable[SliceClaim]) -> dict[str, CardClaim]:
    """Fold the slices of ONE pod into its claim per card uuid.

    Per card and per dimension: ``max(steady, largest init phase)`` where ``steady`` is the
    sum of the app and sidecar slices there and an ordinary init container's phase is its use
    plus the sidecars before it (lower ``container_index``) there; slots count one for an
    init container, one per app or sidecar slice.
    """
    # card -> container index -> (memory, cores); a container normally has one slice per
    # card, but summing keeps a malformed ledger from being under-counted.
    # The memory-like figures of a slice ride together: (memory, resident part, spill).
    init_use: dict[str, dict[int, tuple[int, int, int, int]]] = {}  # (memory, cores, res, spill)
    # card -> [(index, memory, cores, resident, spill)]
    side_use: dict[str, list[tuple[int, int, int, int, int]]] = {}
    # card -> [memory, cores, slices, resident, spill], sidecars included
    app_use: dict[str, list[int]] = {}
    exclusive: set[str] = set()
    masks: dict[str, int] = {}
    for s in slices:
        if s.cores >= EXCLUSIVE_CORES:
            exclusive.add(s.card_uuid)
        if s.mig_size:
            masks[s.card_uuid] = masks.get(s.card_uuid, 0) | s.mig_mask
        res = s.resident
        spill = s.memory_mib - res
        if s.init and not s.sidecar:
            per_container = init_use.setdefault(s.card_uuid, {})
            mem, cores, r, sp = per_container.get(s.container_index, (0, 0, 0, 0))
            per_container[s.container_index] = (
                mem + s.memory_mib, cores + s.cores, r + res, sp + spill
            )  # fmt: skip
            continue
        if s.sidecar:
            side_use.setdefault(s.card_uuid, []).append(
                (s.container_index, s.memory_mib, s.cores, res, spill)
            )
        acc = app_use.setdefault(s.card_uuid, [0, 0, 0, 0, 0])
        acc[0] += s.memory_mib
        acc[1] += s.cores
        acc[2] += 1
        acc[3] += res
        acc[4] += spill
    result: dict[str, CardClaim] = {}
    for card in sorted(init_use.keys() | app_use.keys()):
        mem, cores, slots, res, spill = app_use.get(card, (0, 0, 0, 0, 0))
        sides = side_use.get(card, ())
        for index, (init_mem, init_cores, init_res, init_spill) in init_use.get(card, {}).items():
            before = [s for s in sides if s[0] < index]
            mem = max(mem, init_mem + sum(s[1] for s in before))
            cores = max(cores, init_cores + sum(s[2] for s in before))
            slots = max(slots, 1 + len(before))
            res = max(res, init_res + sum(s[3] for s in before))
            spill = max(spill, init_spill + sum(s[4] for s in before))
        result[card] = CardClaim(
            memory_mib=mem,
            cores=cores,
            slots=slots,
            exclusive=card in exclusive,
            mig_mask=masks.get(card, 0),
            resident_mib=None if res == mem else res,
            spill_mib=spill,
        )
    return result


# (pod, card, container index, init, memory MiB, cores, sidecar): a slice as the ledger stores it,
# with the pod's and the card's row ids; the ledger's rows may carry a MIG placement (start,
# size) after these, which the claims leave out (the snapshot reads it), and then the resident
# part (None: all of it).
LedgerSlice = (
    tuple[int, int, int, bool, int, int, bool]
    | tuple[int, int, int, bool, int, int, bool, int | None, int | None]
    | tuple[int, int, int, bool, int, int, bool, int | None, int | None, int | None]
)


def _resident_of(row: LedgerSlice) -> int | None:
    return row[9] if len(row) > 9 else None  # type: ignore[misc]


def _tally(
    rows: Iterable[LedgerSlice], per_pod: bool
) -> tuple[dict[tuple[int, int], list[int]], dict[int, list[SliceClaim]]]:
    """Sums [memory, cores, slots, exclusive slices, resident, spill] of the pods without init
    slices, keyed
    (pod, card) or (0, card); the slices of the other pods, per pod, for `claims_per_card`.

    A pod without init slices claims exactly the sum of its slices on each card (what
    `claims_per_card` returns for it), so nearly every row is simply added up.
    """
    rows = list(rows)
    with_init = {r[0] for r in rows if r[3]}
    sums: dict[tuple[int, int], list[int]] = {}
    folded: dict[int, list[SliceClaim]] = {}
    for row in rows:
        pod, card, index, init, memory, cores, sidecar = row[:7]
        resident = _resident_of(row)
        if pod in with_init:
            folded.setdefault(pod, []).append(
                SliceClaim(str(card), index, init, memory, cores, sidecar, resident_mib=resident)
            )
            continue
        t = sums.get((pod if per_pod else 0, card))
        if t is None:
            t = sums[(pod if per_pod else 0, card)] = [0, 0, 0, 0, 0, 0]
        t[0] += memory
        t[1] += cores
        t[2] += 1
        t[3] += cores >= EXCLUSIVE_CORES
        res = memory if resident is None else resident
        t[4] += res
        t[5] += memory - res
    return sums, folded


def _claim(t: list[int]) -> CardClaim:
    """A claim from `_tally`'s sums."""
    return CardClaim(t[0], t[1], t[2], bool(t[3]), 0, None if t[4] == t[0] else t[4], t[5])


def pod_claims(rows: Iterable[LedgerSlice]) -> Iterator[tuple[int, int, CardClaim]]:
    """(pod, card, claim) for every pod and card of ledger slices, by `claims_per_card`'s rule."""
    sums, folded = _tally(rows, per_pod=True)
    for (pod, card), t in sums.items():
        yield pod, card, _claim(t)
    for pod, claims in folded.items():
        for card_key, claim in claims_per_card(claims).items():
            yield pod, int(card_key), claim


def card_claims(rows: Iterable[LedgerSlice]) -> dict[int, CardClaim]:
    """Per card, the sum over pods of each pod's claim there (what the card has given away)."""
    sums, folded = _tally(rows, per_pod=False)
    totals = {card: t for (_, card), t in sums.items()}
    for claims in folded.values():
        for card_key, claim in claims_per_card(claims).items():
            t = totals.setdefault(int(card_key), [0, 0, 0, 0, 0, 0])
            t[0] += claim.memory_mib
            t[1] += claim.cores
            t[2] += claim.slots
            t[3] += claim.exclusive
            t[4] += claim.resident
            t[5] += claim.spill_mib
    return {card: _claim(t) for card, t in totals.items()}
