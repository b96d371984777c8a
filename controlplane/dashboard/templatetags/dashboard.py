"""Template helpers: units, percentages, query strings and per-namespace colours."""

from __future__ import annotations

from functools import cache
from html import escape  # the same five characters as Django's escape, without its lazy wrapper
from typing import Any
from urllib.parse import quote

from django import template
from django.http import QueryDict
from django.urls import reverse
from django.utils.safestring import SafeString, mark_safe

from controlplane.dashboard.looks import look_class, preferred_look

register = template.Library()


@register.filter
def mib(value: int | None) -> str:
    """81920 -> '80 GiB', 1536 -> '1.5 GiB', 300 -> '300 MiB'; None -> '∞'."""
    if value is None:
        return "∞"
    if abs(value) >= 1024 * 1024:
        return f"{value / (1024 * 1024):.1f} TiB".replace(".0 ", " ")
    if abs(value) >= 1024:
        return f"{value / 1024:.1f} GiB".replace(".0 ", " ")
    return f"{value} MiB"


@register.filter
def pct(value: float | None, digits: int = 0) -> str:
    """A percentage for display; None -> a dash."""
    if value is None:
        return "\u2013"
    return f"{value:.{int(digits)}f}%"


@register.filter
def clamp100(value: float | None) -> float:
    """A width in percent that stays inside its bar."""
    return 0.0 if value is None else round(min(max(float(value), 0.0), 100.0), 2)


@register.filter
def level(value: float | None) -> str:
    """CSS class by fill level: ok < 75% <= warn < 90% <= full."""
    if value is None:
        return "ok"
    return "full" if value >= 90 else "warn" if value >= 75 else "ok"


@register.simple_tag(takes_context=True)
def ns_look(context: dict[str, Any], namespace: str) -> str:
    """The CSS classes of a namespace's colour on this screen (`ns_looks` of the view)."""
    looks = context.get("ns_looks") or {}
    return look_class(looks.get(namespace, preferred_look(namespace)))


@register.simple_tag(takes_context=True)
def query(context: dict[str, Any], **changes: Any) -> str:
    """The current query string with `changes` applied (None or '' removes a key); page resets
    unless given."""
    request = context["request"]
    params: QueryDict = request.GET.copy()
    params.pop("fragment", None)
    if "page" not in changes:
        params.pop("page", None)
    for key, value in changes.items():
        if value is None or value == "":
            params.pop(key, None)
        else:
            params[key] = str(value)
    encoded = params.urlencode()
    return f"?{encoded}" if encoded else "?"


@register.simple_tag(takes_context=True)
def sort_link(context: dict[str, Any], key: str, current: str) -> str:
    """Query string that sorts by `key`, flipping direction when it is already the sort."""
    new = f"-{key}" if current == key else key
    return query(context, sort=new)


def _state_badge(card: Any) -> str:
    if card.state == "healthy":
        return ""
    css = "cordon" if card.state == "cordoned" else "bad"
    return f'<span class="badge {css}" title="{escape(card.health_reason)}">{card.state}</span>'


def _mode_badge(card: Any) -> str:
    """Nothing for a shared card (most of them); else its mode, or that it is draining."""
    if card.draining:
        status = escape(card.mode_status)
        return f'<span class="badge warn" title="{status}">draining</span>'
    if card.mode == "shared":
        return ""
    return f'<span class="badge mode-{escape(card.mode)}">{escape(card.mode_status)}</span>'


@cache
def _card_url_prefix() -> str:
    """`/cards/` as routed (reverse once per process, not 400 times a page)."""
    return reverse("dashboard:card", args=["x"])[: -len("x/")]


@register.simple_tag(takes_context=True)
def card_bar(context: dict[str, Any], card: Any) -> SafeString:
    """A card's row: name, model, state, and memory and compute bars split into slices.

    Built in Python rather than with an included template: the nodes page draws 400 of these,
    and an include per card (and a loop per slice) costs more than the rest of the page.
    Every value from the ledger is escaped.
    """
    url = f"{_card_url_prefix()}{quote(card.uuid, safe='')}/"
    uuid = escape(card.uuid)
    model = escape(card.model)
    short_model = escape(card.model if len(card.model) <= 26 else card.model[:25] + "\u2026")
    memory_segments = []
    compute_segments = []
    looks = context.get("ns_looks") or {}
    for s in card.slices:
        ns, pod_name, container = escape(s.namespace), escape(s.pod), escape(s.container)
        look = looks.get(s.namespace, preferred_look(s.namespace))
        css = f"seg {look_class(look)}{' init' if s.init else ''}"
        init = " (init)" if s.init else ""
        memory_segments.append(
            f'<span class="{css}" data-width="{clamp100(s.memory_share)}" '
            f'data-pod="{ns}/{pod_name}" title="{ns}/{pod_name} \u00b7 container {container}'
            f'{init} \u00b7 {s.memory_mib} MiB \u00b7 {s.cores}%"></span>'
        )
        compute_segments.append(
            f'<span class="{css}" data-width="{clamp100(s.cores_share)}" '
            f'title="{ns}/{pod_name} \u00b7 container {container}{init} \u00b7 {s.cores}% compute">'
            "</span>"
        )
    used, total = mib(card.usage.memory_mib), mib(card.memory_mib)
    return mark_safe(  # noqa: S308 - every ledger value above is escaped
        f'<div class="cardrow state-{card.state}" data-card="{uuid}">'
        f'<div class="cardmeta"><a href="{url}" class="cardname" title="{uuid}">'
        f'GPU {card.index}</a><span class="model muted" title="{model}">{short_model}</span>'
        f"{_state_badge(card)}{_mode_badge(card)}</div>"
        '<div class="bars">'
        f'<div class="bar" role="img" aria-label="memory: {used} of {total}">'
        f"{''.join(memory_segments)}</div>"
        f'<div class="bar thin" role="img" aria-label="compute: {card.usage.cores} of '
        f'{card.compute_units}">{"".join(compute_segments)}</div></div>'
        f'<div class="cardnums small"><span title="memory allocated">{used} / {total}</span>'
        f'<span title="compute allocated" class="muted">{card.usage.cores}% \u00b7 '
        f"{card.usage.slots}/{card.slots} slots</span></div></div>"
    )


@register.filter
def words(code: str) -> str:
    """A machine code for people: 'insufficient_memory' -> 'insufficient memory'."""
    return str(code).replace("_", " ")
