"""Kubernetes quantity parsing, restricted to whole numbers."""

from __future__ import annotations

import pytest

from controlplane.scheduling import parse_quantity


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (7, 7),
        ("7", 7),
        ("+7", 7),
        ("1k", 1000),
        ("2M", 2_000_000),
        ("1G", 10**9),
        ("1T", 10**12),
        ("1P", 10**15),
        ("1E", 10**18),
        ("1Ki", 1024),
        ("3Mi", 3 * 1024**2),
        ("1Gi", 1024**3),
        ("1Ti", 1024**4),
        ("1Pi", 1024**5),
        ("1Ei", 1024**6),
        ("1e3", 1000),
        ("1E3", 1000),
        ("1.5k", 1500),
        ("0.5Ki", 512),
        ("1000m", 1),
        ("2000000u", 2),
        ("3000000000n", 3),
        (".5e1", 5),
        ("8.", 8),
        (4.0, 4),
    ],
)
def test_whole_quantities_parse_exactly(value: object, expected: int) -> None:
    assert parse_quantity(value) == expected


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("1.5", "whole number"),
        ("500m", "whole number"),
        ("15e-1", "whole number"),
        ("-1", "negative"),
        (-3, "negative"),
        ("abc", "not a Kubernetes quantity"),
        ("", "not a Kubernetes quantity"),
        ("1 Gi", "not a Kubernetes quantity"),
        ("1e", "not a Kubernetes quantity"),
        ("1KB", "not a Kubernetes quantity"),
        ("0x10", "not a Kubernetes quantity"),
        ("1e999999999", "out of range"),
        ("9" * 100, "too long"),
        (True, "boolean"),
        (1.5, "whole number"),
        (float("nan"), "whole number"),
        (None, "quantity string or an integer"),
        ([1], "quantity string or an integer"),
    ],
)
def test_bad_quantities_raise_with_a_reason(value: object, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_quantity(value)
