"""One rule per kind of name, matched against the whole string, at every entry point.

`re.match(r"...$")` accepts a trailing newline, so `team-z\\n` became a quota and `n1\\n` a node
that list exactly like the real ones. Every way a name comes in is tried here with the same
near-misses; each is refused with a 400 (or the entry point's own refusal) naming the field, and
nothing changes.
"""

from __future__ import annotations

import json
from io import StringIO
from typing import Any
from urllib.parse import quote

import pytest
from django.core.management import CommandError, call_command
from django.test import Client

from controlplane.access.roles import Role
from controlplane.dashboard import services as dashboard_services
from controlplane.ledger import validation as v
from controlplane.ledger.errors import ServiceError
from controlplane.ledger.models import AuditEvent, Card, NamespaceQuota, Node, PodBinding
from controlplane.ledger.services import cordons, nodes, quotas
from tests.builders import card_json, make_node, token_client
from tests.dashboard.builders import signed_in


def near_misses(good: str) -> list[str]:
    misses = [
        good + "\n",
        good + "\r\n",
        "\n" + good,
        good + " ",
        " " + good,
        good + "\t",
        good + "\x00",
        good.replace("e", "\u0435"),  # Cyrillic e
        good.replace("a", "\u0430"),  # Cyrillic a
        good.upper(),
        "\uff54" + good[1:],  # full-width t
        "",
    ]
    return [m for m in misses if m != good]


NAMESPACE_MISSES = [*near_misses("team-z"), "a" * 64, "team-", "-team", "team.z", "team_z"]
NODE_MISSES = [*near_misses("gpu-node-1.example"), "a" * 254, "node..1", "node-.1", ".node"]
UUID_MISSES = [
    "GPU-a\n",
    "GPU-a\r\n",
    "GPU-a ",
    "GPU/a",
    "G\u0420U-a",  # Cyrillic P
    "-GPU-a",
    "G" * 65,
    "",
]


@pytest.mark.parametrize(
    ("rule", "good", "misses"),
    [
        (v.is_namespace, ["team-z", "a", "a" * 63, "0-9"], NAMESPACE_MISSES),
        (v.is_container_name, ["trainer", "c0"], NAMESPACE_MISSES),
        (v.is_node_name, ["gpu-node-1.example", "n1", "a" * 253], NODE_MISSES),
        (v.is_pod_name, ["trainer-7f9c4b6d8-x2kqp", "p.1"], NODE_MISSES),
        (v.is_card_uuid, ["GPU-8f3c0000-1111", "MIG-1:2.3_4", "G" * 64], UUID_MISSES),
    ],
)
def test_each_rule_matches_the_whole_string(rule: Any, good: list[str], misses: list[str]) -> None:
    for name in good:
        assert rule(name), name
    for name in misses:
        assert not rule(name), repr(name)
    assert not rule(None) and not rule(7) and not rule(["team-z"])


# --- every entry point ---------------------------------------------------------------------------


def ledger_state() -> tuple[Any, ...]:
    return (
        list(NamespaceQuota.objects.order_by("namespace").values_list("namespace", "gpus")),
        list(Node.objects.order_by("name").values_list("name", "cordoned")),
        list(Card.objects.order_by("uuid").values_list("uuid", "cordoned")),
        list(PodBinding.objects.values_list("pod_uid", "phase")),
        AuditEvent.objects.count(),
    )


@pytest.fixture
def ledger(db: None) -> None:
    make_node("n1", cards=1)
    quotas.set_quota("team-a", quotas.QuotaLimitsInput(gpus=2), "test")


def path_part(name: str) -> str:
    return quote(name, safe="")


def send(client: Client, method: str, url: str, body: Any = None):
    data = None if body is None else json.dumps(body)
    return getattr(client, method)(url, data=data, content_type="application/json")


def rest_cases() -> list[tuple[str, str, str, str, Any, str]]:
    """(who, method, url with {}, kind, body with {} or None, field) for each name input."""
    return [
        ("operator", "post", "/api/v1/quotas/", "namespace", {"namespace": "{}"}, "namespace"),
        ("operator", "put", "/api/v1/quotas/{}/", "namespace", {"gpus": 1}, "namespace"),
        ("operator", "patch", "/api/v1/quotas/team-a/", "namespace", {"namespace": "{}"},
         "namespace"),
        ("operator", "delete", "/api/v1/quotas/{}/", "namespace", None, "namespace"),
        ("viewer", "get", "/api/v1/quotas/{}/", "namespace", None, "namespace"),
        ("viewer", "get", "/api/v1/nodes/{}/", "node", None, "name"),
        ("operator", "post", "/api/v1/nodes/{}/cordon", "node", {}, "name"),
        ("operator", "post", "/api/v1/nodes/{}/uncordon", "node", {}, "name"),
        ("admin", "put", "/api/v1/nodes/{}/inventory", "node",
         {"plugin_version": "x", "cards": []}, "name"),
        ("node", "put", "/api/v1/nodes/n1/inventory", "card",
         {"plugin_version": "x", "cards": [card_json("{}")]}, "cards[0].uuid"),
        ("viewer", "get", "/api/v1/cards/{}/", "card", None, "uuid"),
        ("operator", "post", "/api/v1/cards/{}/cordon", "card", {}, "uuid"),
        ("viewer", "get", "/api/v1/pods/{}/p/why", "namespace", None, "namespace"),
        ("viewer", "get", "/api/v1/pods/default/{}/why", "pod", None, "name"),
        ("viewer", "get", "/api/v1/allocations/{}/p", "namespace", None, "namespace"),
        ("node", "get", "/api/v1/allocations/default/{}", "pod", None, "name"),
        ("node", "post", "/api/v1/allocations/uid-1/containers/{}/allocated", "container",
         {"devices": ["GPU-n1-0"]}, "container"),
    ]  # fmt: skip


MISSES = {"namespace": NAMESPACE_MISSES, "node": NODE_MISSES, "pod": NODE_MISSES}
MISSES |= {"container": NAMESPACE_MISSES, "card": UUID_MISSES}


def fill(body: Any, name: str) -> Any:
    return json.loads(json.dumps(body).replace('"{}"', json.dumps(name)))


@pytest.mark.parametrize(
    ("who", "method", "url", "kind", "body", "field"),
    rest_cases(),
    ids=[f"{c[1]} {c[2]}" for c in rest_cases()],
)
def test_rest_entry_points_refuse_near_miss_names(
    ledger: None, who: str, method: str, url: str, kind: str, body: Any, field: str
) -> None:
    client = token_client("n1" if who == "node" else f"{who}-user", Role(who))
    for name in MISSES[kind]:
        if "{}" in url and (not name or "/" in name):
            continue  # no route: an empty or slashed path part is a different URL (a 404)
        target = url.replace("{}", path_part(name))
        before = ledger_state()
        response = send(client, method, target, None if body is None else fill(body, name))
        assert response.status_code == 400, (name, response.content)
        assert field in response.json()["fields"], (name, response.json())
        assert ledger_state() == before, name


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("key", "good"),
    [("PodNamespace", "default"), ("PodName", "p"), ("Node", "n1")],
)
def test_extender_bind_refuses_near_miss_names(key: str, good: str) -> None:
    make_node("n1", cards=1)
    for name in near_misses(good):
        args = {"PodName": "p", "PodNamespace": "default", "PodUID": "u-1", "Node": "n1"}
        args[key] = name
        before = ledger_state()
        body = Client().post("/scheduler/bind", data=args, content_type="application/json")
        assert key in body.json()["Error"], (name, body.json())
        assert ledger_state() == before


@pytest.mark.django_db
def test_services_refuse_near_miss_names() -> None:
    make_node("n1", cards=1)
    before = ledger_state()
    for name in NAMESPACE_MISSES:
        with pytest.raises(ServiceError):
            quotas.set_quota(name, quotas.QuotaLimitsInput(gpus=1), "test")
    for name in NODE_MISSES:
        with pytest.raises(ServiceError):
            cordons.set_node_cordon(name, True, "test")
        with pytest.raises(ServiceError):
            nodes.apply_inventory(name, nodes.InventoryReport("x", ()), "test")
    assert ledger_state() == before


@pytest.mark.django_db
def test_the_quota_form_refuses_look_alikes_and_stores_only_real_names() -> None:
    client = signed_in(Role.OPERATOR)
    for name in ["t\u0435am-z", "team_z", "a" * 64, "\uff54eam-z"]:
        response = client.post("/quotas/", {"namespace": name, "gpus": "1"})
        assert response.status_code == 400 and b'data-error-for="namespace"' in response.content
    # A form field is trimmed as every Django form field is: what is stored is the real name.
    assert client.post("/quotas/", {"namespace": "team-z\r\n", "gpus": "1"}).status_code == 302
    assert list(NamespaceQuota.objects.values_list("namespace", flat=True)) == ["team-z"]


@pytest.mark.django_db
def test_identities_refuse_near_miss_usernames() -> None:
    for name in near_misses("gpu-node-1"):
        with pytest.raises(CommandError):
            call_command("createtoken", name, "--role", "node", stdout=StringIO())
        with pytest.raises(ServiceError):
            dashboard_services.issue_token(name, Role.NODE, "", "root")
    for name in ["bob\n", "bob\r\n", "bob ", "bob/x", "b" * 151]:
        with pytest.raises(ServiceError):
            dashboard_services.grant_user_role(name, Role.VIEWER, "root")
    from django.contrib.auth import get_user_model

    assert not get_user_model().objects.exists()
    assert not AuditEvent.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize(
    "path", ["/api/v1/nodes/a%2Fb/", "/api/v1/cards/GPU-1%2F2/cordon", "/api/v1/no-such-route/"]
)
def test_an_api_path_no_route_matches_answers_the_json_error_body(path: str) -> None:
    answer = token_client("admin-1", Role.ADMIN).get(path)
    assert answer.status_code == 404
    assert answer["Content-Type"] == "application/json"
    assert answer.json() == {"error": f"Not found: no API route for {answer.wsgi_request.path}."}


@pytest.mark.django_db
def test_a_dashboard_path_no_route_matches_stays_a_page() -> None:
    answer = signed_in(Role.VIEWER).get("/no-such-page/")
    assert answer.status_code == 404 and answer["Content-Type"].startswith("text/html")
