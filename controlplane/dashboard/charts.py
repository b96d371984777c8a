"""Inline SVG charts drawn on the server: no JavaScript chart library, no external assets.

Only numbers and fixed labels go into the markup, and the labels are escaped, so the result is
safe to embed in a page.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe


@dataclass(frozen=True, slots=True)
class Series:
    """One line: a label, a CSS colour class and (time, percent) points."""

    label: str
    css_class: str
    points: Sequence[tuple[datetime, float]]


WIDTH, HEIGHT = 1200, 200
LEFT, RIGHT, TOP, BOTTOM = 40, 10, 10, 22


def percent_chart(series: Sequence[Series], title: str) -> SafeString:
    """A line chart of percentages (0-100) over time, with gridlines and a time axis."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    times = [t for s in series for t, _ in s.points]
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
    ]
    for pct in (0, 25, 50, 75, 100):
        y = TOP + plot_h * (1 - pct / 100)
        parts.append(
            f'<line class="grid" x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}"/>'
            f'<text class="axis" x="{LEFT - 4}" y="{y + 3:.1f}" text-anchor="end">{pct}%</text>'
        )
    if len(times) < 2 or min(times) == max(times):
        parts.append(
            f'<text class="empty" x="{WIDTH / 2:.0f}" y="{HEIGHT / 2:.0f}" text-anchor="middle">'
            "Collecting samples: one a minute</text></svg>"
        )
        return mark_safe("".join(parts))  # noqa: S308 - numbers and escaped labels only
    start, end = min(times), max(times)
    span = (end - start).total_seconds()

    def x_of(t: datetime) -> float:
        return LEFT + plot_w * (t - start).total_seconds() / span

    for fraction in (0.0, 0.5, 1.0):
        t = start + (end - start) * fraction
        anchor = {0.0: "start", 0.5: "middle", 1.0: "end"}[fraction]
        parts.append(
            f'<text class="axis" x="{x_of(t):.1f}" y="{HEIGHT - 6}" '
            f'text-anchor="{anchor}">{t:%H:%M}</text>'
        )
    for s in series:
        coords = " ".join(
            f"{x_of(t):.1f},{TOP + plot_h * (1 - min(max(v, 0.0), 100.0) / 100):.1f}"
            for t, v in s.points
        )
        parts.append(
            f'<polyline class="line {escape(s.css_class)}" points="{coords}">'
            f"<title>{escape(s.label)}</title></polyline>"
        )
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - numbers and escaped labels only


def allocation_chart(samples: Sequence[Any]) -> SafeString:
    """GPU memory and compute allocated (percent of capacity) over AllocationSample rows."""
    return percent_chart(
        [
            Series(
                "GPU memory allocated",
                "memory",
                [
                    (s.bucket, 100 * s.memory_allocated_mib / max(s.memory_total_mib, 1))
                    for s in samples
                ],
            ),
            Series(
                "Compute allocated",
                "compute",
                [(s.bucket, 100 * s.compute_allocated / max(s.compute_total, 1)) for s in samples],
            ),
        ],
        "Allocation over the last 6 hours",
    )
