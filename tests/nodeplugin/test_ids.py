from __future__ import annotations

import pytest

from nodeplugin import ids

A = "GPU-aaaa"
B = "GPU-bbbb"
C = "GPU-cccc"
KNOWN = {A, B, C}
ORDER = {A: 0, B: 1, C: 2}


def test_advertised_ids_are_uuid_and_slot() -> None:
    assert ids.advertised_ids([A, B], 2) == [f"{A}::0", f"{A}::1", f"{B}::0", f"{B}::1"]


def test_over_long_id_is_refused() -> None:
    with pytest.raises(ids.DeviceIdError, match="63"):
        ids.make_id("GPU-" + "x" * 60, 1)


def test_parse_ids_sorts_and_rejects_unknown_and_repeats() -> None:
    parsed = ids.parse_ids([f"{B}::1", f"{A}::3"], KNOWN, 4)
    assert [str(p) for p in parsed] == [f"{A}::3", f"{B}::1"]
    for bad in ([f"{A}::4"], ["GPU-zzzz::0"], [A], [f"{A}::x"], []):
        with pytest.raises(ids.DeviceIdError):
            ids.parse_ids(bad, KNOWN, 4)
    with pytest.raises(ids.DeviceIdError, match="twice"):
        ids.parse_ids([f"{A}::1", f"{A}::1"], KNOWN, 4)


def test_digest_ignores_order_and_names_are_fresh() -> None:
    d1 = ids.ids_digest([f"{A}::1", f"{B}::2"])
    assert d1 == ids.ids_digest([f"{B}::2", f"{A}::1"])
    assert d1 != ids.ids_digest([f"{A}::1", f"{B}::3"])
    n1, n2 = ids.allocation_name(d1, 1), ids.allocation_name(d1, 2)
    assert n1 != n2 and ids.is_allocation_name(n1) and n1.startswith(f"alloc-{d1}-")


def test_preferred_follows_the_wanted_cards() -> None:
    available = [f"{u}::{k}" for u in (A, B, C) for k in range(3)]
    got = ids.choose_preferred(available, [], 2, {C, A}, ORDER, KNOWN, 3)
    assert sorted(got) == [f"{A}::0", f"{C}::0"]


def test_preferred_keeps_must_include_and_spreads_without_a_hint() -> None:
    available = [f"{A}::1", f"{A}::2", f"{B}::0", f"{C}::2"]
    got = ids.choose_preferred(available, [f"{A}::1"], 3, None, ORDER, KNOWN, 3)
    assert got == [f"{A}::1", f"{B}::0", f"{C}::2"]
    # fewer cards than asked: still returns size IDs
    got = ids.choose_preferred([f"{A}::0", f"{A}::1"], [], 2, None, ORDER, KNOWN, 3)
    assert sorted(got) == [f"{A}::0", f"{A}::1"]


def test_preferred_with_a_wanted_card_that_is_full_falls_back() -> None:
    available = [f"{B}::0", f"{C}::0"]
    got = ids.choose_preferred(available, [], 1, {A}, ORDER, KNOWN, 3)
    assert got == [f"{B}::0"]
