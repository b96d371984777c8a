"""Claims from ledger-shaped slice rows (`card_claims`, `pod_claims`) against the core's fold.

They add the rows of pods without init-container slices directly and fold only the others
(sidecars are init containers) through `claims_per_card`; for any rows they must give what
folding every pod gives.
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given
from hypothesis import strategies as st

from controlplane.scheduling import (
    CardClaim,
    LedgerSlice,
    SliceClaim,
    card_claims,
    claims_per_card,
    pod_claims,
)

# (pod, card, container index, init, memory MiB, cores, sidecar); a sidecar is an init container
rows = st.lists(
    st.tuples(
        st.integers(1, 6),
        st.integers(1, 4),
        st.integers(0, 3),
        st.sampled_from(((False, False), (True, False), (True, False), (True, True))),
        st.integers(0, 80_000),
        st.integers(0, 100),
    ).map(lambda r: (r[0], r[1], r[2], r[3][0], r[4], r[5], r[3][1])),
    max_size=40,
)


def per_pod(slices: list[LedgerSlice]) -> dict[int, list[SliceClaim]]:
    by_pod: dict[int, list[SliceClaim]] = defaultdict(list)
    for pod, card, index, init, memory, cores, sidecar in slices:
        by_pod[pod].append(SliceClaim(str(card), index, init, memory, cores, sidecar))
    return by_pod


def folded(slices: list[LedgerSlice]) -> dict[int, CardClaim]:
    totals: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for claims in per_pod(slices).values():
        for card, claim in claims_per_card(claims).items():
            t = totals[int(card)]
            t[0] += claim.memory_mib
            t[1] += claim.cores
            t[2] += claim.slots
            t[3] += claim.exclusive
    return {card: CardClaim(t[0], t[1], t[2], bool(t[3])) for card, t in totals.items()}


@given(rows)
def test_the_ledger_sum_equals_folding_every_pod(slices: list[LedgerSlice]) -> None:
    assert card_claims(slices) == folded(slices)


@given(rows)
def test_each_pods_claims_equal_its_own_fold(slices: list[LedgerSlice]) -> None:
    expected = {
        (pod, int(card)): claim
        for pod, claims in per_pod(slices).items()
        for card, claim in claims_per_card(claims).items()
    }
    assert {(pod, card): claim for pod, card, claim in pod_claims(slices)} == expected


def test_an_init_container_counts_once_beside_the_app_containers() -> None:
    slices: list[LedgerSlice] = [
        (1, 1, 0, True, 6000, 50, False),  # init: 6000 MiB, runs before the apps
        (1, 1, 0, False, 2000, 10, False),
        (1, 1, 1, False, 3000, 10, False),
        (2, 1, 0, False, 1000, 100, False),
    ]
    assert card_claims(slices) == {1: CardClaim(7000, 150, 3, True)}


def test_a_sidecar_counts_beside_later_init_containers_and_the_apps() -> None:
    slices: list[LedgerSlice] = [
        (1, 1, 0, True, 1000, 10, True),  # sidecar, started first: runs to the end
        (1, 1, 1, True, 6000, 50, False),  # init after it: 6000 + 1000 at its peak
        (1, 1, 0, False, 2000, 10, False),  # app: 2000 + 1000
        (2, 1, 0, False, 500, 0, False),
    ]
    assert card_claims(slices) == {1: CardClaim(7500, 60, 3, False)}
    assert {(pod, card): c for pod, card, c in pod_claims(slices)}[(1, 1)] == CardClaim(
        7000, 60, 2, False
    )
