"""Sign-in throttling with django-axes: whose guesses count together, and what a locked-out
person is told.

Axes (configured in controlplane/settings.py) counts failed password sign-ins per username and
client address at `/login/` and `/admin/login/`. This module gives it the two things that are
Tessera's to decide: the client's address, and the refusal.
"""

from __future__ import annotations

import ipaddress
import math
from typing import Any

from axes.helpers import get_cool_off
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.template.loader import render_to_string


def client_ip(request: HttpRequest) -> str | None:
    """The address a sign-in came from.

    Directly (port-forward, Service): the peer. Behind the TLS proxy (TESSERA_BEHIND_TLS_PROXY):
    the entry of X-Forwarded-For that the outermost of TESSERA_PROXY_HOPS trusted proxies
    appended, counted from the right, since every entry left of it is whatever the client sent.
    Without that, every guess would come from the ingress's address, and one attacker could lock
    a username out for everyone. REMOTE_ADDR itself is left alone: the extender's loopback check
    reads it and must never be swayed by a header.
    """
    peer = request.META.get("REMOTE_ADDR") or None
    if not settings.TESSERA["BEHIND_TLS_PROXY"]:
        return peer
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    entries = [e.strip() for e in forwarded.split(",") if e.strip()]
    if not entries:
        return peer
    hops = int(settings.TESSERA["PROXY_HOPS"])
    candidate = entries[max(len(entries) - hops, 0)]
    try:
        return str(ipaddress.ip_address(candidate))
    except ValueError:
        return peer


def locked_out(
    request: HttpRequest, response: HttpResponse | None = None, credentials: Any = None
) -> HttpResponse:
    """The refusal: 429 Too Many Requests with Retry-After, and a page that says what happened,
    for how long, and who can lift it (the same for the dashboard's and the admin's sign-in)."""
    cool_off = get_cool_off(request)
    seconds = max(1, math.ceil(cool_off.total_seconds())) if cool_off else 0
    minutes = max(1, math.ceil(seconds / 60))
    username = (credentials or {}).get("username") or request.POST.get("username", "")
    body = render_to_string(
        "registration/locked_out.html",
        {"username": username, "minutes": minutes, "failure_limit": settings.AXES_FAILURE_LIMIT},
        request=request,
    )
    refusal = HttpResponse(body, status=429)
    if seconds:
        refusal["Retry-After"] = str(seconds)
    return refusal
