"""What `kubectl tessera` prints: aligned tables, or the data as JSON or YAML."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import yaml

UNKNOWN = "-"  # a figure the control plane does not know: never made up


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, two spaces apart, like kubectl's own tables."""
    cells = [[str(h) for h in headers]] + [
        [UNKNOWN if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def dump(data: Any, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2, sort_keys=False)
    return str(yaml.safe_dump(data, sort_keys=False, default_flow_style=False)).rstrip("\n")


def used_of(used: int | None, total: int | None) -> str:
    """`used/total`, `-` standing in for a figure that is not known."""
    return f"{UNKNOWN if used is None else used}/{UNKNOWN if total is None else total}"


def limit(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def percent(part: int | None, whole: int | None) -> str:
    if part is None or not whole:
        return UNKNOWN
    return f"{100 * part // whole}%"
