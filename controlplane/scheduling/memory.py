"""How many MiB one slice takes on a card: the one definition the whole core calls.

A container asks for memory in one of three kinds (docs/scheduling.md, section 1): absolute
MiB, a percent of the chosen card's memory (rounded down), or the whole card. Parsing, the
filter's loops, placement, explanations, scores and quotas all ask :func:`sizer` (or
:func:`slice_mib`, the same for one card); nothing else restates the arithmetic.
"""

from __future__ import annotations

import re
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


# --------------------------------------------------------------- virtual device memory
#
# A card's oversubscription factor f (docs/virtual-memory.md) is kept in hundredths, an int:
# 100 is 1 (off), 150 is 1.5, 1600 is 16, the most. Integers keep the budgets exact (no
# float rounding between the filter, bind and the ledger's SQL) and cost an int comparison.

FACTOR_ONE = 100
FACTOR_MAX = 1600


class FactorError(ValueError):
    """A factor that is not a decimal from 1 to 16 with at most two decimal places."""


#: The factors people may write: a decimal from 1 to 16, at most two decimal places, no sign,
#: no leading zero, no spaces ("1", "1.5", "2.25", "16"). The API's schema publishes it.
FACTOR_PATTERN = r"^(?:(?:[1-9]|1[0-5])(?:\.[0-9]{1,2})?|16(?:\.0{1,2})?)$"
_FACTOR = re.compile(FACTOR_PATTERN)


def parse_factor(text: object) -> int:
    """A factor as written by an operator or a node plugin ("1", "1.5", "2.25") in hundredths.

    Refused, with a sentence saying what is allowed: anything but such a string (below 1, above
    16, more than two decimal places, not a number).
    """
    if not isinstance(text, str) or not _FACTOR.match(text):
        raise FactorError(
            'must be a decimal from "1" to "16" with at most two decimal places, such as "1.5"; '
            f"got {text!r}"
        )
    whole, _, part = text.partition(".")
    return int(whole) * FACTOR_ONE + int(part.ljust(2, "0") or "0")


def format_factor(factor: int) -> str:
    """The factor in hundredths as people write it: 100 -> "1", 150 -> "1.5", 225 -> "2.25"."""
    whole, part = divmod(factor, FACTOR_ONE)
    return str(whole) if not part else f"{whole}.{part:02d}".rstrip("0")


def resident_mib(memory_mib: int, factor: int) -> int:
    """The resident part of an opted-in slice of ``memory_mib`` on a card of ``factor``: the
    MiB that stay on the card, memory / f rounded up to a MiB. A slice without the opt-in, or
    on a card with f = 1, is resident in full (call this only for opted-in slices)."""
    if factor <= FACTOR_ONE:
        return memory_mib
    return -(-memory_mib * FACTOR_ONE // factor)


def virtual_mib(card_mib: int, factor: int) -> int:
    """The most MiB a card's slices may add up to: f x its memory, rounded down."""
    return card_mib * factor // FACTOR_ONE


def factor_refusal(memory_mib: int, used_mib: int, factor: int) -> str | None:
    """Why a card of ``memory_mib`` whose slices hold ``used_mib`` cannot take ``factor``: its
    virtual budget (f x memory) would no longer hold them. None when it can.

    Only the virtual budget depends on the factor: a bound slice keeps the resident part it was
    given (its container runs with it), so the card's resident sum is the same under any
    factor, and a factor decides only the room left for new slices."""
    virtual = virtual_mib(memory_mib, factor)
    if used_mib > virtual:
        return (
            f"its slices hold {used_mib} MiB, more than factor {format_factor(factor)} allows "
            f"({format_factor(factor)} x {memory_mib} MiB = {virtual} MiB); wait for slices "
            "to end or choose a factor of at least "
            f"{format_factor(min_factor(memory_mib, used_mib))}"
        )
    return None


def min_factor(memory_mib: int, used_mib: int) -> int:
    """The smallest factor (hundredths, at least 1) whose virtual budget holds ``used_mib``."""
    if memory_mib <= 0:
        return FACTOR_MAX
    return max(FACTOR_ONE, -(-used_mib * FACTOR_ONE // memory_mib))
