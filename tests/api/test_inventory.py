"""PUT /api/v1/nodes/<name>/inventory: auth, roles, creation, updates and bad input."""

from __future__ import annotations

import json
from typing import Any

import pytest
from rest_framework.test import APIClient

from controlplane.access.roles import Role
from controlplane.ledger.models import AuditEvent, Card, Node
from tests.builders import card_json, token_client

pytestmark = pytest.mark.django_db

URL = "/api/v1/nodes/{}/inventory"


def put(client: APIClient, node: str, body: Any, raw: bool = False):
    data = body if raw else json.dumps(body)
    return client.put(URL.format(node), data=data, content_type="application/json")


def report(*cards: dict[str, Any], version: str = "0.1.0") -> dict[str, Any]:
    return {"plugin_version": version, "cards": list(cards)}


def ledger_state() -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    nodes = list(
        Node.objects.order_by("name").values_list(
            "name",
            "ready",
            "last_heartbeat",
            "plugin_version",
            "usage",
            "usage_at",
            "memory_factor",
            "spill_reserve_mib",
            "host_memory_mib",
        )
    )
    cards = list(
        Card.objects.order_by("uuid").values_list(
            "uuid",
            "node__name",
            "index",
            "model",
            "memory_mib",
            "numa_node",
            "healthy",
            "health_reason",
            "present",
        )
    )
    return nodes, cards


def test_first_report_creates_node_and_cards_then_updates() -> None:
    client = token_client("gpu-1", Role.NODE)
    first = put(client, "gpu-1", report(card_json("GPU-a", 0), card_json("GPU-b", 1)))
    assert first.status_code == 201, first.json()
    assert first.json()["created"] is True
    assert first.json()["cards_added"] == ["GPU-a", "GPU-b"]
    node = Node.objects.get(name="gpu-1")
    assert node.ready and node.last_heartbeat is not None and node.plugin_version == "0.1.0"
    assert sorted(node.cards.values_list("uuid", "memory_mib")) == [
        ("GPU-a", 81920),
        ("GPU-b", 81920),
    ]
    beat = node.last_heartbeat

    second = put(
        client,
        "gpu-1",
        report(card_json("GPU-a", 0, healthy=False, health_reason="XID 79"), version="0.2.0"),
    )
    assert second.status_code == 200, second.json()
    assert second.json()["created"] is False
    assert second.json()["cards_missing"] == ["GPU-b"]
    node.refresh_from_db()
    assert node.last_heartbeat > beat and node.plugin_version == "0.2.0"
    a, b = Card.objects.get(uuid="GPU-a"), Card.objects.get(uuid="GPU-b")
    assert (a.healthy, a.health_reason, a.present) == (False, "XID 79", True)
    assert b.present is False  # stays on record, takes no new slices
    actions = set(AuditEvent.objects.values_list("action", flat=True))
    assert {"node-registered", "card-health", "card-missing"} <= actions


def test_admin_may_report_any_node() -> None:
    client = token_client("root-admin", Role.ADMIN)
    assert put(client, "gpu-9", report(card_json("GPU-z"))).status_code == 201


@pytest.mark.parametrize(
    ("credentials", "status"),
    [
        (None, 401),
        ("Bearer not-a-token", 401),
        ("Bearer two words", 401),
        ("viewer", 403),
        ("operator", 403),
        ("other-node", 403),
    ],
)
def test_auth_and_roles_refused_and_ledger_unchanged(credentials: str | None, status: int) -> None:
    client = APIClient()
    if credentials in ("viewer", "operator"):
        client = token_client(f"{credentials}-person", Role(credentials))
    elif credentials == "other-node":
        client = token_client("gpu-2", Role.NODE)
    elif credentials:
        client.credentials(HTTP_AUTHORIZATION=credentials)
    response = put(client, "gpu-1", report(card_json()))
    assert response.status_code == status, response.content
    assert "error" in response.json()
    assert not Node.objects.exists() and not Card.objects.exists()


def test_revoked_token_is_refused() -> None:
    client = token_client("gpu-1", Role.NODE)
    from controlplane.access.models import ApiToken

    ApiToken.objects.update(revoked=True)
    assert put(client, "gpu-1", report(card_json())).status_code == 401


def used(**kw: Any) -> dict[str, Any]:
    """One container's usage entry on card_json's default card."""
    return {
        "namespace": "team-a",
        "pod": "trainer",
        "container": "main",
        "card": card_json()["uuid"],
        "memory_used_mib": 3000,
        "compute_used_percent": 40,
        **kw,
    }


def with_usage(*entries: dict[str, Any]) -> dict[str, Any]:
    return {**report(card_json()), "usage": list(entries)}


BAD_INPUTS: list[tuple[str, Any, str]] = [
    ("malformed-json", '{"plugin_version": "x", "cards": [', "body"),
    ("not-an-object", "[1, 2]", "body"),
    ("missing-cards", {"plugin_version": "x"}, "cards"),
    ("cards-not-list", {"plugin_version": "x", "cards": {"uuid": "a"}}, "cards"),
    ("version-not-string", {"plugin_version": 3, "cards": []}, "plugin_version"),
    ("memory-string", report(card_json(memory_mib="81920")), "cards[0].memory_mib"),
    ("memory-float", report(card_json(memory_mib=1.5)), "cards[0].memory_mib"),
    ("memory-bool", report(card_json(memory_mib=True)), "cards[0].memory_mib"),
    ("memory-negative", report(card_json(memory_mib=-1)), "cards[0].memory_mib"),
    ("memory-zero", report(card_json(memory_mib=0)), "cards[0].memory_mib"),
    ("memory-absurd", report(card_json(memory_mib=10**12)), "cards[0].memory_mib"),
    ("healthy-string", report(card_json(healthy="yes")), "cards[0].healthy"),
    ("index-negative", report(card_json(index=-1)), "cards[0].index"),
    ("index-string", report(card_json(index="0")), "cards[0].index"),
    ("uuid-number", report(card_json(uuid=5)), "cards[0].uuid"),
    ("uuid-bad-chars", report(card_json(uuid="GPU a/b")), "cards[0].uuid"),
    (
        "uuid-missing",
        report({k: v for k, v in card_json().items() if k != "uuid"}),
        "cards[0].uuid",
    ),
    ("numa-string", report(card_json(numa_node="0")), "cards[0].numa_node"),
    ("duplicate-uuid", report(card_json("GPU-a", 0), card_json("GPU-a", 1)), "cards[1].uuid"),
    ("duplicate-index", report(card_json("GPU-a", 0), card_json("GPU-b", 0)), "cards[1].index"),
    ("too-many-cards", report(*[card_json(f"GPU-{i}", i % 64) for i in range(65)]), "cards"),
    (
        "second-card-bad",
        report(card_json("GPU-a", 0), card_json("GPU-b", 1, model=None)),
        "cards[1].model",
    ),
    ("model-too-long-once-trimmed", report(card_json(model=" " + "m" * 128)), "cards[0].model"),
    ("null-body", "null", "body"),
    ("unknown-field", {**report(card_json()), "node": "gpu-1"}, "node"),
    ("unknown-card-field", report(card_json(slots=4)), "cards[0].slots"),
    ("card-not-object", report("GPU-a"), "cards[0]"),
    ("usage-not-list", {**report(card_json()), "usage": {}}, "usage"),
    ("usage-other-card", with_usage(used(card="GPU-elsewhere")), "usage[0].card"),
    ("usage-duplicate", with_usage(used(), used()), "usage[1]"),
    ("usage-negative", with_usage(used(memory_used_mib=-1)), "usage[0].memory_used_mib"),
    ("usage-float", with_usage(used(memory_used_mib=1.5)), "usage[0].memory_used_mib"),
    ("usage-over-100", with_usage(used(compute_used_percent=101)), "usage[0].compute_used_percent"),
    ("usage-bad-pod", with_usage(used(pod="Not_A_Pod")), "usage[0].pod"),
    ("usage-bad-namespace", with_usage(used(namespace="a" * 64)), "usage[0].namespace"),
    ("usage-bad-container", with_usage(used(container="c/d")), "usage[0].container"),
    ("usage-unknown-key", with_usage(used(pid=7)), "usage[0].pid"),
    ("usage-too-long", with_usage(*[used(pod=f"p{i}") for i in range(4097)]), "usage"),
    # virtual device memory (docs/virtual-memory.md)
    (
        "factor-number",
        {**report(card_json()), "memory_oversubscription": 2},
        "memory_oversubscription",
    ),
    (
        "factor-below-1",
        {**report(card_json()), "memory_oversubscription": "0.5"},
        "memory_oversubscription",
    ),
    (
        "factor-above-16",
        {**report(card_json()), "memory_oversubscription": "16.5"},
        "memory_oversubscription",
    ),
    (
        "factor-3-decimals",
        {**report(card_json()), "memory_oversubscription": "1.125"},
        "memory_oversubscription",
    ),
    (
        "factor-words",
        {**report(card_json()), "memory_oversubscription": "twice"},
        "memory_oversubscription",
    ),
    ("reserve-negative", {**report(card_json()), "spill_reserve_mib": -1}, "spill_reserve_mib"),
    ("reserve-string", {**report(card_json()), "spill_reserve_mib": "1024"}, "spill_reserve_mib"),
    ("host-zero", {**report(card_json()), "host_memory_mib": 0}, "host_memory_mib"),
    (
        "reserve-above-host",
        {**report(card_json()), "spill_reserve_mib": 4096, "host_memory_mib": 2048},
        "spill_reserve_mib",
    ),
    (
        "usage-resident-negative",
        with_usage(used(memory_resident_mib=-1)),
        "usage[0].memory_resident_mib",
    ),
    (
        "usage-spilled-float",
        with_usage(used(memory_spilled_mib=1.5)),
        "usage[0].memory_spilled_mib",
    ),
]


@pytest.mark.parametrize(("case", "body", "field"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_the_field_and_changes_nothing(case: str, body: Any, field: str) -> None:
    client = token_client("gpu-1", Role.NODE)
    assert put(client, "gpu-1", report(card_json("GPU-keep", 0))).status_code == 201
    before = ledger_state()
    response = put(client, "gpu-1", body, raw=isinstance(body, str))
    assert response.status_code == 400, response.content
    payload = response.json()
    assert field in payload["fields"], payload
    assert payload["error"] and payload["fields"][field]
    assert ledger_state() == before


def test_a_report_of_more_cards_than_a_node_can_have_says_the_limit() -> None:
    client = token_client("gpu-1", Role.NODE)
    response = put(client, "gpu-1", report(*[card_json(f"GPU-{i}", i % 64) for i in range(65)]))
    assert response.status_code == 400
    message = response.json()["fields"]["cards"]
    assert "At most 64 cards in one report" in message
    assert not Node.objects.exists() and not Card.objects.exists()


def test_invalid_node_name_is_400() -> None:
    client = token_client("root-admin", Role.ADMIN)
    response = put(client, "Bad_Name", report(card_json()))
    assert response.status_code == 400
    assert "name" in response.json()["fields"]
    assert not Node.objects.exists()


def test_card_of_another_node_is_refused_and_nothing_changes() -> None:
    one, two = token_client("gpu-1", Role.NODE), token_client("gpu-2", Role.NODE)
    assert put(one, "gpu-1", report(card_json("GPU-shared", 0))).status_code == 201
    assert put(two, "gpu-2", report(card_json("GPU-own", 0))).status_code == 201
    before = ledger_state()
    response = put(two, "gpu-2", report(card_json("GPU-own", 0), card_json("GPU-shared", 1)))
    assert response.status_code == 409
    assert "cards[1].uuid" in response.json()["fields"]
    assert "gpu-1" in response.json()["error"]
    assert ledger_state() == before


def test_oversized_body_is_refused() -> None:
    client = token_client("gpu-1", Role.NODE)
    body = report(card_json(health_reason="x" * 2_000_000))
    response = put(client, "gpu-1", body)
    assert response.status_code in (400, 413)
    assert "error" in response.json()
    assert not Node.objects.exists()


def test_wrong_method_and_content_type() -> None:
    client = token_client("gpu-1", Role.NODE)
    assert client.get(URL.format("gpu-1")).status_code == 405
    response = client.put(URL.format("gpu-1"), data="a=b", content_type="text/plain")
    assert response.status_code == 415
    assert not Node.objects.exists()


# --- card modes: the MIG object, the modes answer, defaults for new cards -----------------------


def mig(capable: bool = True, enabled: bool = True, *instances: dict[str, Any]) -> dict[str, Any]:
    return {"capable": capable, "enabled": enabled, "instances": list(instances)}


def instance(start: int = 0, size: int = 4, profile: str = "3g.40gb", **kw: Any) -> dict[str, Any]:
    return {"profile": profile, "start": start, "size": size, "uuid": f"MIG-{start}", **kw}


def test_a_report_with_mig_is_stored_and_one_without_keeps_what_is_known() -> None:
    client = token_client("gpu-1", Role.NODE)
    body = report(card_json("GPU-a", 0, mig=mig(True, True, instance(4))), card_json("GPU-b", 1))
    first = put(client, "gpu-1", body)
    assert first.status_code == 201, first.json()
    assert first.json()["modes"] == {"GPU-a": "shared", "GPU-b": "shared"}
    a = Card.objects.get(uuid="GPU-a")
    assert (a.mig_capable, a.mig_enabled) == (True, True)
    assert a.mig_instances == [{"profile": "3g.40gb", "start": 4, "size": 4, "uuid": "MIG-4"}]
    b = Card.objects.get(uuid="GPU-b")
    assert (b.mig_capable, b.mig_enabled, b.mig_instances) == (False, False, [])
    # An older plugin's report (no `mig`) says nothing about MIG: what is known stays.
    assert put(client, "gpu-1", report(card_json("GPU-a", 0))).status_code == 200
    a.refresh_from_db()
    assert (a.mig_capable, a.mig_enabled, len(a.mig_instances)) == (True, True, 1)
    # A plugin that reports MIG off now is believed.
    off = report(card_json("GPU-a", 0, mig=mig(True, False)))
    assert put(client, "gpu-1", off).status_code == 200
    a.refresh_from_db()
    assert (a.mig_capable, a.mig_enabled, a.mig_instances) == (True, False, [])


def test_the_answer_carries_each_card_s_mode_for_the_plugin() -> None:
    client = token_client("gpu-1", Role.NODE)
    put(client, "gpu-1", report(card_json("GPU-a", 0), card_json("GPU-b", 1)))
    Card.objects.filter(uuid="GPU-b").update(mode="mps")
    answer = put(client, "gpu-1", report(card_json("GPU-a", 0), card_json("GPU-b", 1))).json()
    assert answer["modes"] == {"GPU-a": "shared", "GPU-b": "mps"}
    # A card missing from this report is still the node's: its mode is in the answer too.
    assert put(client, "gpu-1", report(card_json("GPU-a", 0))).json()["modes"] == answer["modes"]


def test_defaults_give_a_new_card_its_mode_first_match_wins_and_audited(settings: Any) -> None:
    settings.TESSERA = {
        **settings.TESSERA,
        "CARD_MODE_DEFAULTS": (
            {"model": "a100", "mode": "mig"},
            {"model": "A100", "mode": "exclusive"},
            {"model": "L4", "mode": "mps"},
        ),
    }
    client = token_client("gpu-1", Role.NODE)
    body = report(
        card_json("GPU-a", 0, mig=mig(True, False)),
        card_json("GPU-b", 1),  # an A100 the plugin does not report MIG-capable
        card_json("GPU-c", 2, model="NVIDIA L4"),
        card_json("GPU-d", 3, model="Tesla T4"),
    )
    assert put(client, "gpu-1", body).json()["modes"] == {
        "GPU-a": "mig", "GPU-b": "shared", "GPU-c": "mps", "GPU-d": "shared",
    }  # fmt: skip
    events = {
        e.target: (e.actor, e.details["to"], e.details["reason"])
        for e in AuditEvent.objects.filter(action="card-mode")
    }
    assert events == {
        "GPU-a": ("system", "mig", "TESSERA_CARD_MODE_DEFAULTS[0] (model 'a100')"),
        "GPU-b": ("system", "shared", "TESSERA_CARD_MODE_DEFAULTS[0] (model 'a100') asks mig, "
                  "but the card is not reported MIG-capable: shared"),
        "GPU-c": ("system", "mps", "TESSERA_CARD_MODE_DEFAULTS[2] (model 'L4')"),
    }  # fmt: skip
    # Defaults apply when a card first registers, never again.
    Card.objects.filter(uuid="GPU-c").update(mode="shared")
    put(client, "gpu-1", body)
    assert Card.objects.get(uuid="GPU-c").mode == "shared"
    assert AuditEvent.objects.filter(action="card-mode").count() == 3


I0 = "cards[0].mig.instances[0]"
MIG_BAD_INPUTS: list[tuple[str, Any, str]] = [
    ("mig-not-object", "yes", "cards[0].mig"),
    ("mig-capable-string", {"capable": "true", "enabled": False}, "cards[0].mig.capable"),
    ("mig-enabled-missing", {"capable": True}, "cards[0].mig.enabled"),
    ("mig-unknown-key", {**mig(), "mode": "mig"}, "cards[0].mig.mode"),
    ("mig-enabled-not-capable", mig(False, True), "cards[0].mig.enabled"),
    ("mig-instances-while-off", mig(True, False, instance()), "cards[0].mig.instances"),
    ("mig-instances-not-list", {**mig(), "instances": {"a": 1}}, "cards[0].mig.instances"),
    ("mig-profile-bad", mig(True, True, instance(profile="3g 40gb")), f"{I0}.profile"),
    ("mig-start-negative", mig(True, True, instance(start=-1)), f"{I0}.start"),
    ("mig-start-string", mig(True, True, instance(start="0")), f"{I0}.start"),
    ("mig-size-zero", mig(True, True, instance(size=0)), f"{I0}.size"),
    ("mig-past-the-end", mig(True, True, instance(start=12, size=8)), f"{I0}.size"),
    ("mig-uuid-bad", mig(True, True, instance(uuid="MIG a")), f"{I0}.uuid"),
    ("mig-instance-unknown-key", mig(True, True, instance(gi=1)), f"{I0}.gi"),
    ("mig-duplicate-uuid", mig(True, True, instance(0), instance(4, uuid="MIG-0")),
     "cards[0].mig.instances[1].uuid"),
    ("mig-too-many", mig(True, True, *[instance(i % 8, 1, uuid=f"MIG-{i}") for i in range(17)]),
     "cards[0].mig.instances"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "mig_body", "field"), MIG_BAD_INPUTS, ids=[c[0] for c in MIG_BAD_INPUTS]
)
def test_a_bad_mig_object_names_the_field_and_changes_nothing(
    case: str, mig_body: Any, field: str
) -> None:
    client = token_client("gpu-1", Role.NODE)
    assert put(client, "gpu-1", report(card_json("GPU-keep", 0, mig=mig()))).status_code == 201
    before = ledger_state(), list(Card.objects.values_list("mig_capable", "mig_enabled"))
    response = put(client, "gpu-1", report(card_json("GPU-keep", 0, mig=mig_body)))
    assert response.status_code == 400, response.content
    assert field in response.json()["fields"], response.json()
    after = ledger_state(), list(Card.objects.values_list("mig_capable", "mig_enabled"))
    assert after == before


def test_usage_is_stored_replaced_and_kept_by_a_report_without_it() -> None:
    client = token_client("gpu-1", Role.NODE)
    body = with_usage(used(), used(pod="idle", compute_used_percent=None))
    assert put(client, "gpu-1", body).status_code == 201
    node = Node.objects.get(name="gpu-1")
    assert node.usage == [used(), used(pod="idle", compute_used_percent=None)]
    first_at = node.usage_at
    assert first_at == node.last_heartbeat
    # A heartbeat without `usage` (an older plugin, or sampling failed): what is known stays.
    assert put(client, "gpu-1", report(card_json())).status_code == 200
    node.refresh_from_db()
    assert node.usage == [used(), used(pod="idle", compute_used_percent=None)]
    assert node.usage_at == first_at < node.last_heartbeat
    # An empty list is news: nothing runs on the cards now.
    assert put(client, "gpu-1", with_usage()).status_code == 200
    node.refresh_from_db()
    assert node.usage == [] and node.usage_at == node.last_heartbeat


def test_the_virtual_memory_settings_are_stored_and_absent_ones_mean_the_defaults() -> None:
    client = token_client("gpu-1", Role.NODE)
    body = {
        **with_usage(used(memory_resident_mib=2000, memory_spilled_mib=1000)),
        "memory_oversubscription": "1.5",
        "spill_reserve_mib": 8192,
        "host_memory_mib": 65536,
    }
    assert put(client, "gpu-1", body).status_code == 201
    node = Node.objects.get(name="gpu-1")
    assert (node.memory_factor, node.spill_reserve_mib, node.host_memory_mib) == (150, 8192, 65536)
    assert node.usage == [used(memory_resident_mib=2000, memory_spilled_mib=1000)]
    assert put(client, "gpu-1", report(card_json())).status_code == 200
    node.refresh_from_db()
    assert (node.memory_factor, node.spill_reserve_mib, node.host_memory_mib) == (100, 0, None)
