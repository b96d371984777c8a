"""What one pod holds on each card, with Kubernetes init-container semantics.

Init containers run one at a time before the app containers start, so a pod never needs
its init and app slices at the same moment. Like the kubelet's effective-request rule, the
pod's claim on a card is the larger of its biggest single init container there and the sum
of its app containers there. Fit uses exactly this rule, and the control plane sums ledger
rows through it, so the two never disagree on how much room a pod takes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SliceClaim:
    """One recorded slice (a row of the ledger)."""

    card_uuid: str
    container_index: int
    init: bool
    memory_mib: int
    cores: int


@dataclass(frozen=True, slots=True)
class CardClaim:
    """The room one pod takes on one card.

    ``exclusive`` is True when any of the pod's slices there asks for 100% compute; no
    other pod may then share the card.
    """

    memory_mib: int
    cores: int
    slots: int
    exclusive: bool


def claims_per_card(slices: Iterable[SliceClaim]) -> dict[str, CardClaim]:
    """Fold the slices of ONE pod into its claim per card uuid.

    Per card and per dimension: ``max(largest init container's use, sum of app use)``;
    slots: ``max(1 if any init slice is there, number of app slices there)``.
    """
    # card -> container index -> (memory, cores); a container normally has one slice per
    # card, but summing keeps a malformed ledger from being under-counted.
    init_use: dict[str, dict[int, tuple[int, int]]] = {}
    app_use: dict[str, list[int]] = {}  # card -> [memory, cores, slices]
    exclusive: set[str] = set()
    for s in slices:
        if s.cores >= 100:
            exclusive.add(s.card_uuid)
        if s.init:
            per_container = init_use.setdefault(s.card_uuid, {})
            mem, cores = per_container.get(s.container_index, (0, 0))
            per_container[s.container_index] = (mem + s.memory_mib, cores + s.cores)
        else:
            acc = app_use.setdefault(s.card_uuid, [0, 0, 0])
            acc[0] += s.memory_mib
            acc[1] += s.cores
            acc[2] += 1
    result: dict[str, CardClaim] = {}
    for card in sorted(init_use.keys() | app_use.keys()):
        app_mem, app_cores, app_slots = app_use.get(card, (0, 0, 0))
        inits = init_use.get(card, {}).values()
        init_mem = max((m for m, _ in inits), default=0)
        init_cores = max((c for _, c in inits), default=0)
        result[card] = CardClaim(
            memory_mib=max(init_mem, app_mem),
            cores=max(init_cores, app_cores),
            slots=max(1 if inits else 0, app_slots),
            exclusive=card in exclusive,
        )
    return result
