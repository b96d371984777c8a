"""The one definition of how many MiB a slice takes on a card (docs/scheduling.md, section 1)."""

from __future__ import annotations

import pytest

from controlplane.scheduling import ContainerRequest
from controlplane.scheduling.memory import MemoryKind, memory_ask, slice_mib


@pytest.mark.parametrize(
    ("kind", "value", "card", "mib"),
    [
        (MemoryKind.MIB, 3000, 81920, 3000),  # absolute: the card does not matter
        (MemoryKind.MIB, 3000, 1024, 3000),  # ... even a card too small (fit refuses it)
        (MemoryKind.PERCENT, 25, 81920, 20480),
        (MemoryKind.PERCENT, 33, 24576, 8110),  # 8110.08, rounded down
        (MemoryKind.PERCENT, 1, 99, 0),  # 0.99 rounds down to nothing
        (MemoryKind.PERCENT, 100, 40960, 40960),
        (MemoryKind.WHOLE, 100, 40960, 40960),
        (MemoryKind.WHOLE, 100, 0, 0),
    ],
)
def test_slice_mib(kind: MemoryKind, value: int, card: int, mib: int) -> None:
    assert slice_mib(kind, value, card) == mib


def test_a_container_asks_through_the_one_rule() -> None:
    assert memory_ask(3000, None) == (MemoryKind.MIB, 3000)
    assert memory_ask(None, 25) == (MemoryKind.PERCENT, 25)
    assert memory_ask(None, None) == (MemoryKind.WHOLE, 100)
    for mib, pct in ((3000, None), (None, 33), (None, None)):
        c = ContainerRequest("c", 0, False, 1, mib, pct, 0)
        for card in (99, 24576, 81920):
            assert c.memory_on(card) == slice_mib(*memory_ask(mib, pct), card)


def test_memory_kinds_compare_as_the_ints_they_stand_for() -> None:
    assert (MemoryKind.MIB, MemoryKind.PERCENT, MemoryKind.WHOLE) == (0, 1, 2)
