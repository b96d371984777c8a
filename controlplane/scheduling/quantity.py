"""A small parser for Kubernetes quantity strings, restricted to whole numbers.

Extended resources in Kubernetes must be whole numbers, so everything here resolves to an
``int`` or fails with a :class:`ValueError` whose text says what is wrong. The arithmetic
uses :class:`fractions.Fraction` so that "1.5k" or "1000m" are exact, never float-rounded.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

# The exponent alternative comes first so "1E3" is 1000 while a bare "1E" is one exa.
_QUANTITY = re.compile(
    r"(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<exp>[eE][+-]?[0-9]+)|(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<decimal>[numkMGTPE]))?"
)

# Longer strings or larger exponents are never meaningful for a GPU request, and refusing
# them keeps a hostile "1e999999999" from costing seconds of big-integer arithmetic.
_MAX_TEXT = 64
_MAX_EXPONENT = 30


def parse_quantity(value: object) -> int:
    """Return ``value`` (a quantity string or an int) as a non-negative whole number.

    Accepts plain integers, decimal suffixes (n u m k M G T P E), binary suffixes
    (Ki Mi Gi Ti Pi Ei) and exponent forms ("1e3"). Raises :class:`ValueError` with a
    sentence naming the problem for fractions, negatives, booleans and anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number, got the boolean {str(value).lower()}")
    if isinstance(value, int):
        amount = Fraction(value)
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"expected a whole number, got {value}")
        amount = Fraction(value)
    elif isinstance(value, str):
        amount = _parse_text(value)
    else:
        raise ValueError(f"expected a quantity string or an integer, got {type(value).__name__}")
    if amount < 0:
        raise ValueError(f"must not be negative, got {value!r}")
    if amount.denominator != 1:
        raise ValueError(f"must be a whole number, got {value!r}")
    return int(amount)


def _parse_text(text: str) -> Fraction:
    if len(text) > _MAX_TEXT:
        raise ValueError(f"quantity is too long ({len(text)} characters)")
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity (examples: 2, 1500, 4k, 1e3)")
    digits = match["number"]
    sign = -1 if match["sign"] == "-" else 1
    if match["exp"] is not None:
        exponent = int(match["exp"][1:])
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"exponent in {text!r} is out of range")
        # Fraction reads "1.5e3" exactly; no float is involved anywhere.
        return sign * Fraction(f"{digits}e{exponent}")
    if match["binary"] is not None:
        return sign * Fraction(digits) * _BINARY[match["binary"]]
    if match["decimal"] is not None:
        return sign * Fraction(f"{digits}e{_DECIMAL[match['decimal']]}")
    return sign * Fraction(digits)
