"""The ledger's per-card sum of pod claims (selectors._card_claims) against the core's fold.

The selector adds the rows of pods without init-container slices directly and folds only the
others through `claims_per_card`; for any rows it must give what folding every pod gives.
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given
from hypothesis import strategies as st

from controlplane.ledger import selectors
from controlplane.ledger.sql import SliceRow
from controlplane.scheduling import CardClaim, SliceClaim, claims_per_card

rows = st.lists(
    st.builds(
        SliceRow,
        binding_id=st.integers(1, 6),
        card_id=st.integers(1, 4),
        container_index=st.integers(0, 3),
        init=st.booleans(),
        memory_mib=st.integers(0, 80_000),
        cores=st.integers(0, 100),
    ),
    max_size=40,
)


def folded(slices: list[SliceRow]) -> dict[int, CardClaim]:
    by_pod: dict[int, list[SliceClaim]] = defaultdict(list)
    for r in slices:
        by_pod[r.binding_id].append(
            SliceClaim(str(r.card_id), r.container_index, r.init, r.memory_mib, r.cores)
        )
    totals: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for claims in by_pod.values():
        for card, claim in claims_per_card(claims).items():
            t = totals[int(card)]
            t[0] += claim.memory_mib
            t[1] += claim.cores
            t[2] += claim.slots
            t[3] += claim.exclusive
    return {card: CardClaim(t[0], t[1], t[2], bool(t[3])) for card, t in totals.items()}


@given(rows)
def test_the_ledger_sum_equals_folding_every_pod(slices: list[SliceRow]) -> None:
    assert selectors._card_claims(slices) == folded(slices)


def test_an_init_container_counts_once_beside_the_app_containers() -> None:
    slices = [
        SliceRow(1, 1, 0, True, 6000, 50),  # init: 6000 MiB, runs before the apps
        SliceRow(1, 1, 0, False, 2000, 10),
        SliceRow(1, 1, 1, False, 3000, 10),
        SliceRow(2, 1, 0, False, 1000, 100),
    ]
    assert selectors._card_claims(slices) == {1: CardClaim(7000, 150, 3, True)}
