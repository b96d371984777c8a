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
    ends).
    """

    memory_mib: int
    cores: int
    slots: int
    exclusive: bool
    mig_mask: int = 0


def claims_per_card(slices: Iterable[SliceClaim]) -> dict[str, CardClaim]:
    """Fold the slices of ONE pod into its claim per card uuid.

    Per card and per dimension: ``max(steady, largest init phase)`` where ``steady`` is the
    sum of the app and sidecar slices there and an ordinary init container's phase is its use
    plus the sidecars before it (lower ``container_index``) there; slots count one for an
    init container, one per app or sidecar slice.
    """
    # card -> container index -> (memory, cores); a container normally has one slice per
    # card, but summing keeps a malformed ledger from being under-counted.
    init_use: dict[str, dict[int, tuple[int, int]]] = {}
    side_use: dict[str, list[tuple[int, int, int]]] = {}  # card -> [(index, memory, cores)]
    app_use: dict[str, list[int]] = {}  # card -> [memory, cores, slices], sidecars included
    exclusive: set[str] = set()
    masks: dict[str, int] = {}
    for s in slices:
        if s.cores >= EXCLUSIVE_CORES:
            exclusive.add(s.card_uuid)
        if s.mig_size:
            masks[s.card_uuid] = masks.get(s.card_uuid, 0) | s.mig_mask
        if s.init and not s.sidecar:
            per_container = init_use.setdefault(s.card_uuid, {})
            mem, cores = per_container.get(s.container_index, (0, 0))
            per_container[s.container_index] = (mem + s.memory_mib, cores + s.cores)
            continue
        if s.sidecar:
            side_use.setdefault(s.card_uuid, []).append((s.container_index, s.memory_mib, s.cores))
        acc = app_use.setdefault(s.card_uuid, [0, 0, 0])
        acc[0] += s.memory_mib
        acc[1] += s.cores
        acc[2] += 1
    result: dict[str, CardClaim] = {}
    for card in sorted(init_use.keys() | app_use.keys()):
        mem, cores, slots = app_use.get(card, (0, 0, 0))
        sides = side_use.get(card, ())
        for index, (init_mem, init_cores) in init_use.get(card, {}).items():
            before = [s for s in sides if s[0] < index]
            mem = max(mem, init_mem + sum(s[1] for s in before))
            cores = max(cores, init_cores + sum(s[2] for s in before))
            slots = max(slots, 1 + len(before))
        result[card] = CardClaim(
            memory_mib=mem,
            cores=cores,
            slots=slots,
            exclusive=card in exclusive,
            mig_mask=masks.get(card, 0),
        )
    return result


# (pod, card, container index, init, memory MiB, cores, sidecar): a slice as the ledger stores it,
# with the pod's and the card's row ids; the ledger's rows may carry a MIG placement (start,
# size) after these, which the claims leave out (the snapshot reads it).
LedgerSlice = (
    tuple[int, int, int, bool, int, int, bool]
    | tuple[int, int, int, bool, int, int, bool, int | None, int | None]
)


def _tally(
    rows: Iterable[LedgerSlice], per_pod: bool
) -> tuple[dict[tuple[int, int], list[int]], dict[int, list[SliceClaim]]]:
    """Sums [memory, cores, slots, exclusive slices] of the pods without init slices, keyed
    (pod, card) or (0, card); the slices of the other pods, per pod, for `claims_per_card`.

    A pod without init slices claims exactly the sum of its slices on each card (what
    `claims_per_card` returns for it), so nearly every row is simply added up.
    """
    rows = list(rows)
    with_init = {r[0] for r in rows if r[3]}
    sums: dict[tuple[int, int], list[int]] = {}
    folded: dict[int, list[SliceClaim]] = {}
    for pod, card, index, init, memory, cores, sidecar, *_ in rows:  # the ledger's MIG columns
        if pod in with_init:
            folded.setdefault(pod, []).append(
                SliceClaim(str(card), index, init, memory, cores, sidecar)
            )
            continue
        t = sums.get((pod if per_pod else 0, card))
        if t is None:
            t = sums[(pod if per_pod else 0, card)] = [0, 0, 0, 0]
        t[0] += memory
        t[1] += cores
        t[2] += 1
        t[3] += cores >= EXCLUSIVE_CORES
    return sums, folded


def pod_claims(rows: Iterable[LedgerSlice]) -> Iterator[tuple[int, int, CardClaim]]:
    """(pod, card, claim) for every pod and card of ledger slices, by `claims_per_card`'s rule."""
    sums, folded = _tally(rows, per_pod=True)
    for (pod, card), t in sums.items():
        yield pod, card, CardClaim(t[0], t[1], t[2], bool(t[3]))
    for pod, claims in folded.items():
        for card_key, claim in claims_per_card(claims).items():
            yield pod, int(card_key), claim


def card_claims(rows: Iterable[LedgerSlice]) -> dict[int, CardClaim]:
    """Per card, the sum over pods of each pod's claim there (what the card has given away)."""
    sums, folded = _tally(rows, per_pod=False)
    totals = {card: t for (_, card), t in sums.items()}
    for claims in folded.values():
        for card_key, claim in claims_per_card(claims).items():
            t = totals.setdefault(int(card_key), [0, 0, 0, 0])
            t[0] += claim.memory_mib
            t[1] += claim.cores
            t[2] += claim.slots
            t[3] += claim.exclusive
    return {card: CardClaim(t[0], t[1], t[2], bool(t[3])) for card, t in totals.items()}
