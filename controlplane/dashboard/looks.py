"""Namespace colours on the dashboard: a look per namespace, none repeated on one screen.

Eight hues that stay distinguishable for the common colour-vision deficiencies (Okabe-Ito order,
darkened where white text sits on them), each plain, striped or dotted: 24 looks, told apart by
pattern where hue alone fails (CSS classes `h0`..`h7` and `p0`..`p2`). Past 24 namespaces on one
screen looks repeat; the legend still names each.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

HUES = 8
PATTERNS = 3
LOOKS = HUES * PATTERNS


def preferred_look(namespace: str) -> int:
    """The look a namespace has wherever no other namespace on screen took it first."""
    return zlib.crc32(namespace.encode("utf-8")) % LOOKS


def namespace_looks(namespaces: Iterable[str]) -> dict[str, int]:
    """A look per namespace, none repeated among these (up to LOOKS of them).

    Each namespace takes its preferred look, or the next one free when another namespace of the
    set prefers the same; ties go by name. The answer depends only on the set, so a screen that
    polls keeps its colours, and a namespace keeps its look across screens while it has no rival.
    """
    looks: dict[str, int] = {}
    taken: set[int] = set()
    for ns in sorted(set(namespaces), key=lambda n: (preferred_look(n), n)):
        look = preferred_look(ns)
        if len(taken) < LOOKS:
            while look in taken:
                look = (look + 1) % LOOKS
        taken.add(look)
        looks[ns] = look
    return looks


def look_class(look: int) -> str:
    return f"h{look % HUES} p{look // HUES}"
