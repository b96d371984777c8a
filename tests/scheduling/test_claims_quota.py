"""claims_per_card (init-peak folding) and quota arithmetic."""

from __future__ import annotations

import pytest

from controlplane.scheduling import (
    Assignment,
    CardClaim,
    QuotaLimits,
    QuotaUsage,
    ReasonCode,
    SliceClaim,
    check_quota,
    claims_per_card,
    usage_of,
)


def s(card: str, index: int, memory: int, cores: int = 0, init: bool = False) -> SliceClaim:
    return SliceClaim(
        card_uuid=card, container_index=index, init=init, memory_mib=memory, cores=cores
    )


def test_app_slices_on_one_card_add_up() -> None:
    claims = claims_per_card([s("A", 0, 1000, 10), s("A", 1, 2000, 20), s("B", 1, 500)])
    assert claims == {
        "A": CardClaim(memory_mib=3000, cores=30, slots=2, exclusive=False),
        "B": CardClaim(memory_mib=500, cores=0, slots=1, exclusive=False),
    }


def test_init_claim_is_the_largest_init_container_not_the_sum() -> None:
    claims = claims_per_card([s("A", 0, 4000, 10, init=True), s("A", 1, 3000, 50, init=True)])
    assert claims == {"A": CardClaim(memory_mib=4000, cores=50, slots=1, exclusive=False)}


@pytest.mark.parametrize(
    ("slices", "expected"),
    [
        # init bigger than the apps: init wins on memory, apps on cores
        (
            [s("A", 0, 9000, 10, init=True), s("A", 0, 2000, 20), s("A", 1, 3000, 30)],
            CardClaim(memory_mib=9000, cores=50, slots=2, exclusive=False),
        ),
        # apps bigger than the init
        (
            [s("A", 0, 1000, 90, init=True), s("A", 0, 2000), s("A", 1, 3000)],
            CardClaim(memory_mib=5000, cores=90, slots=2, exclusive=False),
        ),
        # an init slice alone still holds a slot
        ([s("A", 0, 10, init=True)], CardClaim(memory_mib=10, cores=0, slots=1, exclusive=False)),
        # exclusive from an init container marks the claim exclusive
        (
            [s("A", 0, 10, 100, init=True), s("A", 0, 20, 0)],
            CardClaim(memory_mib=20, cores=100, slots=1, exclusive=True),
        ),
    ],
)
def test_peak_per_dimension(slices: list[SliceClaim], expected: CardClaim) -> None:
    assert claims_per_card(slices) == {"A": expected}


def test_two_slices_of_one_init_container_on_one_card_are_summed() -> None:
    # Malformed ledger data must not be under-counted.
    claims = claims_per_card([s("A", 0, 100, 10, init=True), s("A", 0, 200, 10, init=True)])
    assert claims["A"].memory_mib == 300
    assert claims["A"].cores == 20


def test_no_slices_no_claims() -> None:
    assert claims_per_card([]) == {}


def test_assignment_to_claim() -> None:
    a = Assignment("main", 2, True, "GPU-1", 300, 40)
    assert a.to_claim() == SliceClaim("GPU-1", 2, True, 300, 40)


def test_usage_of_sums_claims() -> None:
    claims = claims_per_card(
        [s("A", 0, 1000, 10), s("A", 1, 1000, 10), s("B", 0, 500, 5, init=True)]
    )
    assert usage_of(claims) == QuotaUsage(memory_mib=2500, cores=25, gpus=3)
    assert usage_of({}) == QuotaUsage()


def test_usage_adds() -> None:
    assert QuotaUsage(1, 2, 3) + QuotaUsage(10, 20, 30) == QuotaUsage(11, 22, 33)


UNLIMITED = QuotaLimits(memory_mib=None, cores=None, gpus=None)


@pytest.mark.parametrize(
    ("limits", "used", "demand"),
    [
        (UNLIMITED, QuotaUsage(10**9, 10**6, 10**4), QuotaUsage(10**9, 10**6, 10**4)),
        (QuotaLimits(1000, 100, 2), QuotaUsage(500, 50, 1), QuotaUsage(500, 50, 1)),  # at limit
        (QuotaLimits(0, 0, 0), QuotaUsage(), QuotaUsage()),
    ],
)
def test_within_quota(limits: QuotaLimits, used: QuotaUsage, demand: QuotaUsage) -> None:
    assert check_quota("team-a", limits, used, demand) is None


@pytest.mark.parametrize(
    ("limits", "used", "demand", "fragments", "permanent"),
    [
        (
            QuotaLimits(32768, None, None),
            QuotaUsage(30000, 0, 0),
            QuotaUsage(8000, 0, 0),
            ["GPU memory: 30000 MiB used + 8000 MiB requested > 32768 MiB limit"],
            False,
        ),
        (
            QuotaLimits(None, 100, None),
            QuotaUsage(0, 0, 0),
            QuotaUsage(0, 150, 0),
            ["GPU compute: 0% used + 150% requested > 100% limit"],
            True,
        ),
        (
            QuotaLimits(None, None, 4),
            QuotaUsage(0, 0, 4),
            QuotaUsage(0, 0, 1),
            ["GPU slices: 4 used + 1 requested > 4 limit"],
            False,
        ),
        (
            QuotaLimits(100, 10, 1),
            QuotaUsage(100, 10, 1),
            QuotaUsage(1, 1, 1),
            ["GPU memory:", "GPU compute:", "GPU slices:"],
            False,
        ),
    ],
)
def test_quota_exceeded_names_dimension_and_figures(
    limits: QuotaLimits,
    used: QuotaUsage,
    demand: QuotaUsage,
    fragments: list[str],
    permanent: bool,
) -> None:
    refusal = check_quota("team-a", limits, used, demand)
    assert refusal is not None
    assert refusal.code is ReasonCode.QUOTA_EXCEEDED
    assert refusal.card_uuid is None
    assert "namespace team-a" in refusal.message
    for fragment in fragments:
        assert fragment in refusal.message
    assert refusal.permanent is permanent
