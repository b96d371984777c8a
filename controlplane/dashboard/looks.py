"""Namespace colours on the dashboard: a look per namespace, none repeated on one screen.

Eight hues that stay distinguishable for the common colour-vision deficiencies (Okabe-Ito order,
darkened where white text sits on them), each plain, striped or dotted: 24 looks (CSS classes
`h0`..`h7` and `p0`..`p2`). The namespaces on one screen get distinct hues first: up to eight
never share a colour, and only past eight does a pattern tell two namespaces of one hue apart.
Past 24 looks repeat; the legend still names each.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

HUES = 8
PATTERNS = 3
LOOKS = HUES * PATTERNS


def preferred_look(namespace: str) -> int:
    """The look (a plain hue) a namespace has wherever no other namespace on screen claims it."""
    return zlib.crc32(namespace.encode("utf-8")) % HUES


def namespace_looks(namespaces: Iterable[str]) -> dict[str, int]:
    """A look per namespace, none repeated among these (up to LOOKS of them), hues before
    patterns.

    First every namespace whose preferred hue no namespace of the set with a smaller name also
    prefers takes it; then the others, by preferred hue and name, take the next free plain hue,
    and when all eight are taken the next free striped one, then dotted. The answer depends only
    on the set, so a screen that polls keeps its colours, and a namespace keeps its colour on
    every screen where no other namespace prefers it.
    """
    ordered = sorted(set(namespaces), key=lambda n: (preferred_look(n), n))
    looks: dict[str, int] = {}
    taken: set[int] = set()
    for ns in ordered:
        look = preferred_look(ns)
        if look not in taken:
            looks[ns] = look
            taken.add(look)
    for ns in ordered:
        if ns in looks:
            continue
        looks[ns] = _next_free(preferred_look(ns), taken)
        taken.add(looks[ns])
    return looks


def _next_free(hue: int, taken: set[int]) -> int:
    """The first look not taken, from `hue` onwards: every plain hue, then every striped one,
    then every dotted one; `hue` itself once all are taken."""
    for pattern in range(PATTERNS):
        for step in range(HUES):
            look = pattern * HUES + (hue + step) % HUES
            if look not in taken:
                return look
    return hue


def look_class(look: int) -> str:
    return f"h{look % HUES} p{look // HUES}"
