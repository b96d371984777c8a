"""What the dashboard's selectors share: the page size and a percentage that is 0 of nothing."""

from __future__ import annotations

PAGE_SIZE = 50


def percent(part: int, whole: int) -> float:
    """`part` as a percentage of `whole`; 0 when `whole` is 0."""
    return 100.0 * part / whole if whole else 0.0
