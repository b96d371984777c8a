"""OPTIONS on every route, for every kind of caller: an answer, never a 5xx."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from controlplane.access.roles import Role
from controlplane.ledger.services import quotas
from tests.builders import make_node, token_client
from tests.dashboard.builders import signed_in

pytestmark = pytest.mark.django_db

# A value for each path parameter the URLconf names (the ones the admin names included).
SAMPLES = {
    "name": "n1",
    "namespace": "team-a",
    "uuid": "GPU-n1-0",
    "pod_uid": "uid-1",
    "container": "c",
    "app_label": "ledger",
    "object_id": "1",
    "id": "1",
    "content_type_id": "1",
    "url": "x",
    "path": "x",
}


def _concrete(pattern: Any) -> str:
    text = str(pattern)
    text = re.sub(r"\(\?P<(\w+)>[^)]*\)", lambda m: SAMPLES[m.group(1)], text)  # re_path()
    text = re.sub(r"<(?:\w+:)?(\w+)>", lambda m: SAMPLES[m.group(1)], text)  # path() routes
    return text.lstrip("^").replace("/?$", "").replace("$", "").replace("\\", "")


def routes(patterns: list[Any] | None = None, prefix: str = "/") -> list[str]:
    out: list[str] = []
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        here = prefix + _concrete(entry.pattern)
        if isinstance(entry, URLResolver):
            out += routes(entry.url_patterns, here)
        elif isinstance(entry, URLPattern):
            out.append(here)
    return sorted(set(out))


ROUTES = routes()


def test_the_walk_finds_every_api_route() -> None:
    api = {r for r in ROUTES if r.startswith("/api/")}
    for expected in [
        "/api/v1/quotas/team-a/",
        "/api/v1/nodes/n1/cordon",
        "/api/v1/nodes/n1/inventory",
        "/api/v1/cards/GPU-n1-0/uncordon",
        "/api/v1/pods/team-a/n1/why",
        "/api/v1/allocations/uid-1/containers/c/allocated",
        "/api/schema/",
    ]:
        assert expected in api
    assert "/scheduler/bind" in ROUTES and "/webhook/mutate" in ROUTES
    assert len(ROUTES) > 40  # the admin's routes are walked too


def caller(who: str) -> Client:
    if who == "none":
        return APIClient()
    if who == "node":
        return token_client("n1", Role.NODE)
    if who.startswith("session-"):
        return signed_in(Role(who.removeprefix("session-")))
    return token_client(f"{who}-user", Role(who))


@pytest.mark.parametrize(
    "who",
    ["none", "viewer", "operator", "admin", "node", "session-viewer", "session-admin"],
)
def test_options_never_fails_on_any_route(who: str) -> None:
    make_node("n1", cards=1)
    quotas.set_quota("team-a", quotas.QuotaLimitsInput(gpus=2), "test")
    client = caller(who)
    failures = {}
    for route in ROUTES:
        response = client.options(route)
        if response.status_code >= 500:
            failures[route] = (response.status_code, response.content[:200])
    assert not failures


def test_options_tells_a_writer_the_fields_it_may_send() -> None:
    quotas.set_quota("team-a", quotas.QuotaLimitsInput(gpus=2), "test")
    body = token_client("otto", Role.OPERATOR).options("/api/v1/quotas/team-a/").json()
    assert set(body["actions"]["PUT"]) >= {"gpumem_mib", "gpucores", "gpus"}
    viewer = token_client("vera", Role.VIEWER).options("/api/v1/quotas/team-a/").json()
    assert "actions" not in viewer  # a viewer may not PUT: no form to offer
