"""How many MiB one slice takes on a card: the one definition the whole core calls.

A container asks for memory in one of three kinds (docs/scheduling.md, section 1): absolute
MiB, a percent of the chosen card's memory (rounded down), or the whole card. Parsing, the
filter's loops, placement, explanations, scores and quotas all ask :func:`sizer` (or
:func:`slice_mib`, the same for one card); nothing else restates the arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum


class MemoryKind(IntEnum):
    """What a container's memory number means. An ``IntEnum``: the filter's loops compare
    it with plain ints at the cost of an int comparison."""

    MIB = 0  # absolute MiB per slice
    PERCENT = 1  # percent of the chosen card's memory
    WHOLE = 2  # the whole card


# The members as module names: on Python 3.11 reading ``MemoryKind.MIB`` goes through the enum
# class (about 10x a global read), and the loops below run per card.
MIB, PERCENT, WHOLE = MemoryKind.MIB, MemoryKind.PERCENT, MemoryKind.WHOLE


def memory_ask(memory_mib: int | None, memory_percent: int | None) -> tuple[MemoryKind, int]:
    """A container's memory ask as (kind, value): MiB if given, else the percent, else the
    whole card (value 100)."""
    if memory_mib is not None:
        return MIB, memory_mib
    if memory_percent is not None:
        return PERCENT, memory_percent
    return WHOLE, 100


def sizer(kind: int, value: int) -> Callable[[int], int]:
    """The MiB one slice of ask (``kind``, ``value``) takes, as a function of the card's total.

    A percent is of the card actually chosen, rounded down, as HAMi books it. A function made
    once per ask, because the greedy and the filter call it per card: deciding the kind on
    every card made ``place_on_node`` of a 4 x 2 GPUs pod 4 % slower (21.8 against 20.9 us).
    """
    if kind == MIB:
        return lambda card_mib: value
    if kind == PERCENT:
        return lambda card_mib: card_mib * value // 100
    return _whole


def _whole(card_mib: int) -> int:
    return card_mib


def slice_mib(kind: int, value: int, card_mib: int) -> int:
    """MiB one slice of ask (``kind``, ``value``) takes on a card of ``card_mib`` in total."""
    return sizer(kind, value)(card_mib)
