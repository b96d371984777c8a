"""Operations API: quotas CRUD, read endpoints with filters and pagination, cordons, roles."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.access.roles import Role
from controlplane.ledger.models import AuditEvent, Card, NamespaceQuota, Node
from tests.builders import token_client
from tests.dashboard.builders import make_node, person, pod
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db

QUOTAS = "/api/v1/quotas/"


def send(client: APIClient, method: str, url: str, body: Any = None, raw: bool = False):
    data = body if raw or body is None else json.dumps(body)
    return getattr(client, method)(url, data=data, content_type="application/json")


def quota_state() -> list[tuple[Any, ...]]:
    return list(
        NamespaceQuota.objects.order_by("namespace").values_list(
            "namespace", "gpumem_mib", "gpucores", "gpus"
        )
    )


@pytest.fixture
def viewer() -> APIClient:
    return token_client("vera-viewer", Role.VIEWER)


@pytest.fixture
def operator() -> APIClient:
    return token_client("otto-operator", Role.OPERATOR)


# --- authentication and roles --------------------------------------------------------------------

READS = [
    QUOTAS,
    "/api/v1/nodes/",
    "/api/v1/cards/",
    "/api/v1/slices/",
    "/api/v1/bindings/",
    "/api/v1/nodes/n1/",
    "/api/v1/cards/GPU-n1-0/",
    "/api/v1/quotas/team-a/",
]
WRITES = [
    ("post", QUOTAS, {"namespace": "team-b", "gpus": 1}),
    ("put", "/api/v1/quotas/team-a/", {"gpus": 9}),
    ("patch", "/api/v1/quotas/team-a/", {"gpus": 9}),
    ("delete", "/api/v1/quotas/team-a/", None),
    ("post", "/api/v1/nodes/n1/cordon", {}),
    ("post", "/api/v1/nodes/n1/uncordon", {}),
    ("post", "/api/v1/cards/GPU-n1-0/cordon", {}),
    ("post", "/api/v1/cards/GPU-n1-0/uncordon", {}),
    ("post", "/api/v1/cards/GPU-n1-0/mode", {"mode": "mps"}),
    ("post", "/api/v1/cards/GPU-n1-0/memory-oversubscription", {"factor": "2"}),
]


@pytest.fixture
def small_cluster() -> None:
    make_node("n1", cards=2, memory_mib=10000)
    pod("a", "n1", gpu_container(mem=3000, cores=20), namespace="team-a")
    NamespaceQuota.objects.create(namespace="team-a", gpumem_mib=8000)


def ledger_snapshot() -> tuple[Any, ...]:
    return (
        quota_state(),
        list(Node.objects.values_list("name", "cordoned")),
        list(Card.objects.values_list("uuid", "cordoned", "mode", "pending_mode")),
        AuditEvent.objects.count(),
    )


@pytest.mark.parametrize("url", READS)
@pytest.mark.parametrize(
    ("who", "status"),
    [(None, 401), ("bad-token", 401), ("node", 403), ("norole", 403), ("viewer", 200)],
)
def test_reads_need_viewer(small_cluster: None, url: str, who: str | None, status: int) -> None:
    client = APIClient()
    if who == "bad-token":
        client.credentials(HTTP_AUTHORIZATION="Bearer tsr_not-a-real-token")
    elif who == "node":
        client = token_client("n1", Role.NODE)
    elif who == "norole":
        # force_login: the sign-in throttle needs the request that Client.login() does not pass
        client.force_login(person("nobody", None))
    elif who == "viewer":
        client = token_client("vera", Role.VIEWER)
    response = client.get(url)
    assert response.status_code == status, response.content
    if status != 200:
        assert "error" in response.json()


@pytest.mark.parametrize(("method", "url", "body"), WRITES)
@pytest.mark.parametrize(("who", "status"), [(None, 401), ("node", 403), ("viewer", 403)])
def test_writes_need_operator_and_change_nothing(
    small_cluster: None, method: str, url: str, body: Any, who: str | None, status: int
) -> None:
    client = APIClient()
    if who == "node":
        client = token_client("n1", Role.NODE)
    elif who == "viewer":
        client = token_client("vera", Role.VIEWER)
    before = ledger_snapshot()
    response = send(client, method, url, body)
    assert response.status_code == status, response.content
    assert ledger_snapshot() == before


def test_session_writes_need_csrf(small_cluster: None) -> None:
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(person("olga", Role.OPERATOR))
    assert client.get(QUOTAS).status_code == 200  # session reads work
    before = ledger_snapshot()
    response = send(client, "post", QUOTAS, {"namespace": "team-z", "gpus": 1})
    assert response.status_code == 403
    assert "CSRF" in response.json()["error"]
    assert ledger_snapshot() == before


# --- quotas --------------------------------------------------------------------------------------


def test_quota_crud_with_audit(operator: APIClient, viewer: APIClient) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod("a", "n1", gpu_container(mem=3000, cores=20), namespace="team-a")

    created = send(operator, "post", QUOTAS, {"namespace": "team-a", "gpumem_mib": 8000})
    assert created.status_code == 201, created.json()
    body = created.json()
    assert body["namespace"] == "team-a"
    assert (body["gpumem_mib"], body["gpucores"], body["gpus"]) == (8000, None, None)
    assert body["usage"] == {"gpumem_mib": 3000, "gpucores": 20, "gpus": 1}
    assert body["updated_by"] == "otto-operator"

    again = send(operator, "post", QUOTAS, {"namespace": "team-a", "gpus": 1})
    assert again.status_code == 409 and "namespace" in again.json()["fields"]

    listed = viewer.get(QUOTAS).json()
    assert listed["count"] == 1 and listed["results"][0]["gpumem_mib"] == 8000
    assert viewer.get("/api/v1/quotas/team-a/").json()["usage"]["gpumem_mib"] == 3000

    patched = send(operator, "patch", "/api/v1/quotas/team-a/", {"gpus": 4})
    assert patched.status_code == 200
    assert (patched.json()["gpumem_mib"], patched.json()["gpus"]) == (8000, 4)

    replaced = send(operator, "put", "/api/v1/quotas/team-a/", {"gpucores": 150})
    assert replaced.status_code == 200
    assert quota_state() == [("team-a", None, 150, None)]  # PUT replaces: absent = unlimited

    fresh = send(operator, "put", "/api/v1/quotas/team-b/", {"namespace": "team-b", "gpus": 0})
    assert fresh.status_code == 201 and fresh.json()["gpus"] == 0

    assert send(operator, "delete", "/api/v1/quotas/team-a/").status_code == 204
    assert send(operator, "delete", "/api/v1/quotas/team-a/").status_code == 404
    assert viewer.get("/api/v1/quotas/team-a/").status_code == 404
    assert quota_state() == [("team-b", None, None, 0)]

    events = list(
        AuditEvent.objects.filter(target_type="quota")
        .order_by("id")
        .values_list("actor", "action", "target")
    )
    assert events == [
        ("otto-operator", "quota-set", "team-a"),
        ("otto-operator", "quota-set", "team-a"),
        ("otto-operator", "quota-set", "team-a"),
        ("otto-operator", "quota-set", "team-b"),
        ("otto-operator", "quota-delete", "team-a"),
    ]
    last_set = AuditEvent.objects.filter(action="quota-set", target="team-a").order_by("id").last()
    assert last_set.details["before"]["gpus"] == 4 and last_set.details["after"]["gpucores"] == 150


def test_patch_of_missing_quota_is_404(operator: APIClient) -> None:
    response = send(operator, "patch", "/api/v1/quotas/team-x/", {"gpus": 1})
    assert response.status_code == 404
    assert quota_state() == []


BAD_QUOTAS: list[tuple[str, str, str, Any, str]] = [
    ("malformed-json", "post", QUOTAS, '{"namespace": ', "body"),
    ("not-an-object", "post", QUOTAS, "[1, 2]", "body"),
    ("missing-namespace", "post", QUOTAS, {"gpus": 1}, "namespace"),
    ("namespace-number", "post", QUOTAS, {"namespace": 7}, "namespace"),
    ("namespace-upper", "post", QUOTAS, {"namespace": "Team-A"}, "namespace"),
    ("namespace-underscore", "post", QUOTAS, {"namespace": "team_a"}, "namespace"),
    ("namespace-too-long", "post", QUOTAS, {"namespace": "a" * 64}, "namespace"),
    ("namespace-dash-end", "post", QUOTAS, {"namespace": "team-"}, "namespace"),
    ("mem-string", "post", QUOTAS, {"namespace": "ok", "gpumem_mib": "100"}, "gpumem_mib"),
    ("mem-float", "post", QUOTAS, {"namespace": "ok", "gpumem_mib": 1.5}, "gpumem_mib"),
    ("mem-bool", "post", QUOTAS, {"namespace": "ok", "gpumem_mib": True}, "gpumem_mib"),
    ("mem-negative", "post", QUOTAS, {"namespace": "ok", "gpumem_mib": -1}, "gpumem_mib"),
    ("mem-absurd", "post", QUOTAS, {"namespace": "ok", "gpumem_mib": 2**62}, "gpumem_mib"),
    ("cores-negative", "post", QUOTAS, {"namespace": "ok", "gpucores": -5}, "gpucores"),
    ("gpus-string", "post", QUOTAS, {"namespace": "ok", "gpus": "3"}, "gpus"),
    ("gpus-list", "post", QUOTAS, {"namespace": "ok", "gpus": [3]}, "gpus"),
    ("unknown-field", "post", QUOTAS, {"namespace": "ok", "gpu_mem": 5}, "gpu_mem"),
    ("url-namespace-bad", "put", "/api/v1/quotas/Bad_NS/", {"gpus": 1}, "namespace"),
    ("body-namespace-differs", "put", "/api/v1/quotas/keep/", {"namespace": "x"}, "namespace"),
    ("put-negative", "put", "/api/v1/quotas/keep/", {"gpus": -1}, "gpus"),
    ("patch-string", "patch", "/api/v1/quotas/keep/", {"gpucores": "50"}, "gpucores"),
    ("patch-unknown", "patch", "/api/v1/quotas/keep/", {"limit": 5}, "limit"),
    # Read-only fields of the answer are the server's: sent back, they are refused, not dropped.
    ("post-usage", "post", QUOTAS, {"namespace": "ok", "usage": {"gpus": 5}}, "usage"),
    ("post-updated-by", "post", QUOTAS, {"namespace": "ok", "updated_by": "eve"}, "updated_by"),
    ("put-usage", "put", "/api/v1/quotas/keep/", {"gpus": 1, "usage": None}, "usage"),
    ("patch-updated-at", "patch", "/api/v1/quotas/keep/", {"updated_at": None}, "updated_at"),
    ("null-body", "post", QUOTAS, "null", "body"),
    ("put-list-body", "put", "/api/v1/quotas/keep/", "[]", "body"),
]


@pytest.mark.parametrize(
    ("case", "method", "url", "body", "field"), BAD_QUOTAS, ids=[c[0] for c in BAD_QUOTAS]
)
def test_bad_quota_input_names_the_field_and_changes_nothing(
    operator: APIClient, case: str, method: str, url: str, body: Any, field: str
) -> None:
    assert send(operator, "post", QUOTAS, {"namespace": "keep", "gpus": 2}).status_code == 201
    before = ledger_snapshot()
    response = send(operator, method, url, body, raw=isinstance(body, str))
    assert response.status_code == 400, response.content
    payload = response.json()
    assert field in payload["fields"], payload
    assert payload["error"] and payload["fields"][field]
    assert ledger_snapshot() == before


# --- read endpoints ------------------------------------------------------------------------------


@pytest.fixture
def cluster() -> None:
    make_node("n1", cards=2, memory_mib=10000)
    make_node("n2", cards=2, memory_mib=20000)
    make_node("n3", cards=1, memory_mib=10000, healthy=False, health_reason="XID 79")
    pod("a1", "n1", gpu_container(mem=3000, cores=20), namespace="team-a")
    pod("a2", "n2", gpu_container(gpus=2, mem=5000, cores=50), namespace="team-a")
    pod("b1", "n1", gpu_container(mem=1000, cores=10), namespace="team-b", phase="reserved")
    pod("b2", "n2", gpu_container(mem=1000, cores=10), namespace="team-b", phase="released")


def results(client: APIClient, url: str) -> list[dict[str, Any]]:
    response = client.get(url)
    assert response.status_code == 200, response.content
    return response.json()["results"]


def test_nodes_list_and_filters(cluster: None, viewer: APIClient) -> None:
    nodes = results(viewer, "/api/v1/nodes/")
    assert [n["name"] for n in nodes] == ["n1", "n2", "n3"]
    n1 = nodes[0]
    assert n1["memory_mib"] == 20000 and n1["memory_allocated_mib"] == 4000
    assert sum(c["memory_allocated_mib"] for c in n1["cards"]) == 4000
    assert sum(len(c["slots_allocated"] * "x") for c in n1["cards"]) == 2
    assert [n["name"] for n in results(viewer, "/api/v1/nodes/?healthy=false")] == ["n3"]
    assert [n["name"] for n in results(viewer, "/api/v1/nodes/?healthy=true")] == ["n1", "n2"]
    assert [n["name"] for n in results(viewer, "/api/v1/nodes/?name=2")] == ["n2"]
    Node.objects.filter(name="n2").update(cordoned=True, ready=False)
    assert [n["name"] for n in results(viewer, "/api/v1/nodes/?cordoned=true")] == ["n2"]
    assert [n["name"] for n in results(viewer, "/api/v1/nodes/?ready=false")] == ["n2"]
    detail = viewer.get("/api/v1/nodes/n2/").json()
    assert detail["cordoned"] is True and len(detail["cards"]) == 2
    assert viewer.get("/api/v1/nodes/nope/").status_code == 404


def test_cards_list_and_filters(cluster: None, viewer: APIClient) -> None:
    cards = results(viewer, "/api/v1/cards/?node=n2")
    assert [c["uuid"] for c in cards] == ["GPU-n2-0", "GPU-n2-1"]
    assert all(c["memory_allocated_mib"] == 5000 and c["compute_allocated"] == 50 for c in cards)
    sick = results(viewer, "/api/v1/cards/?healthy=false")
    assert [(c["uuid"], c["health_reason"]) for c in sick] == [("GPU-n3-0", "XID 79")]
    assert len(results(viewer, "/api/v1/cards/?cordoned=false")) == 5
    assert results(viewer, "/api/v1/cards/?model=h100") == []
    detail = viewer.get("/api/v1/cards/GPU-n2-0/").json()
    assert [(s["namespace"], s["pod"], s["memory_mib"]) for s in detail["slices"]] == [
        ("team-a", "a2", 5000)
    ]
    assert viewer.get("/api/v1/cards/GPU-none/").status_code == 404


def test_slices_list_and_filters(cluster: None, viewer: APIClient) -> None:
    active = results(viewer, "/api/v1/slices/")
    assert sorted(s["pod"] for s in active) == ["a1", "a2", "a2", "b1"]
    assert {s["pod"] for s in results(viewer, "/api/v1/slices/?namespace=team-b")} == {"b1"}
    assert [s["pod"] for s in results(viewer, "/api/v1/slices/?active=false")] == ["b2"]
    assert len(results(viewer, "/api/v1/slices/?active=any")) == 5
    on_card = results(viewer, "/api/v1/slices/?card=GPU-n2-1")
    assert [(s["pod"], s["node"]) for s in on_card] == [("a2", "n2")]
    assert {s["pod"] for s in results(viewer, "/api/v1/slices/?node=n1")} == {"a1", "b1"}
    assert results(viewer, "/api/v1/slices/?pod=a1")[0]["memory_mib"] == 3000


def test_slices_carry_what_their_container_uses_while_the_report_is_fresh(
    cluster: None, viewer: APIClient, settings: Any
) -> None:
    a1 = results(viewer, "/api/v1/slices/?pod=a1")[0]
    assert (a1["memory_used_mib"], a1["compute_used_percent"], a1["used_at"]) == (None,) * 3
    reported = timezone.now()
    entry = {"namespace": "team-a", "pod": "a1", "container": a1["container"], "card": a1["card"]}
    Node.objects.filter(name="n1").update(
        usage=[
            {**entry, "memory_used_mib": 2900, "compute_used_percent": 17},
            # the same container name in another namespace: not a1's
            {**entry, "namespace": "team-b", "memory_used_mib": 1, "compute_used_percent": 1},
        ],
        usage_at=reported,
    )
    a1 = results(viewer, "/api/v1/slices/?pod=a1")[0]
    assert (a1["memory_used_mib"], a1["compute_used_percent"]) == (2900, 17)
    assert a1["used_at"] is not None
    b1 = results(viewer, "/api/v1/slices/?pod=b1")[0]
    assert b1["memory_used_mib"] is None  # n1's report has nothing of b1's container
    # A report older than a node may stay silent is not passed off as now.
    Node.objects.filter(name="n1").update(
        usage_at=reported - timedelta(seconds=settings.TESSERA["NODE_STALE_AFTER_S"] + 1)
    )
    assert results(viewer, "/api/v1/slices/?pod=a1")[0]["memory_used_mib"] is None


def test_bindings_list_filters_and_sort(cluster: None, viewer: APIClient) -> None:
    names = [b["name"] for b in results(viewer, "/api/v1/bindings/?sort=pod")]
    assert names == ["a1", "a2", "b1", "b2"]
    assert [b["name"] for b in results(viewer, "/api/v1/bindings/?sort=-pod")] == names[::-1]
    team_b = results(viewer, "/api/v1/bindings/?namespace=team-b&sort=pod")
    assert [(b["name"], b["phase"]) for b in team_b] == [("b1", "reserved"), ("b2", "released")]
    assert [b["name"] for b in results(viewer, "/api/v1/bindings/?phase=reserved")] == ["b1"]
    on_n2 = results(viewer, "/api/v1/bindings/?node=n2&sort=pod")
    assert [b["name"] for b in on_n2] == ["a2", "b2"]
    by_card = results(viewer, "/api/v1/bindings/?card=GPU-n2-1")
    assert [b["name"] for b in by_card] == ["a2"]
    assert len(by_card[0]["slices"]) == 2
    assert [b["name"] for b in results(viewer, "/api/v1/bindings/?name=a")] == ["a2", "a1"]


@pytest.mark.parametrize(
    ("url", "field"),
    [
        ("/api/v1/nodes/?healthy=maybe", "healthy"),
        ("/api/v1/nodes/?ready=2", "ready"),
        ("/api/v1/cards/?cordoned=yesno", "cordoned"),
        ("/api/v1/slices/?active=sometimes", "active"),
        ("/api/v1/bindings/?phase=running", "phase"),
        ("/api/v1/bindings/?sort=size", "sort"),
        ("/api/v1/bindings/?page_size=501", "page_size"),
        ("/api/v1/bindings/?page_size=0", "page_size"),
        ("/api/v1/nodes/?page_size=ten", "page_size"),
        ("/api/v1/cards/?page=-1", "page"),
        ("/api/v1/quotas/?page=x", "page"),
    ],
)
def test_bad_filters_name_the_field(cluster: None, viewer: APIClient, url: str, field: str) -> None:
    response = viewer.get(url)
    assert response.status_code == 400, response.content
    assert field in response.json()["fields"]


LISTS = [
    "/api/v1/quotas/",
    "/api/v1/nodes/",
    "/api/v1/cards/",
    "/api/v1/slices/",
    "/api/v1/bindings/",
]
# What int() or str.isdigit() take that a page number is not: superscript and Arabic-Indic
# digits (isdigit() is true for both; int() refuses '²' and reads '٣' as 3), full-width digits,
# exponent, sign, spaces, underscores, more digits than int() converts.
NOT_NUMBERS = ["²", "٣", "\uff11", "1e3", "-1", "+1", " 1", "1 ", "1_0", "0x1", "1.0", "", "0"]


@pytest.mark.parametrize("url", LISTS)
@pytest.mark.parametrize("param", ["page", "page_size"])
@pytest.mark.parametrize("raw", NOT_NUMBERS, ids=range(len(NOT_NUMBERS)))
def test_page_numbers_are_ascii_digits_or_a_400(
    cluster: None, viewer: APIClient, url: str, param: str, raw: str
) -> None:
    response = viewer.get(url, {param: raw})
    if raw == "" and param == "page_size":  # empty: the default, as with no parameter at all
        assert response.status_code == 200, response.content
        return
    assert response.status_code == 400, response.content
    body = response.json()
    assert param in body["fields"]
    assert len(body["error"]) < 200  # the junk is not echoed back in full


@pytest.mark.parametrize("url", LISTS)
def test_a_page_number_past_the_end_is_a_404_however_large(
    cluster: None, viewer: APIClient, url: str
) -> None:
    for page in ["99", "9" * 18, "9" * 19, "9" * 5000]:  # 5,000 digits: past what int() reads
        response = viewer.get(url, {"page": page})
        assert response.status_code == 404, response.content
        assert "past the last page" in response.json()["error"]
        assert len(response.json()["error"]) < 200
    for size in ["9" * 19, "9" * 5000]:
        assert viewer.get(url, {"page_size": size}).status_code == 400


def test_pagination_shape_and_links(viewer: APIClient) -> None:
    for i in range(7):
        make_node(f"node-{i:02d}", cards=1)
    first = viewer.get("/api/v1/nodes/?page_size=3").json()
    assert first["count"] == 7 and len(first["results"]) == 3
    assert first["previous"] is None and "page=2" in first["next"]
    assert "page_size=3" in first["next"]
    last = viewer.get("/api/v1/nodes/?page_size=3&page=3").json()
    assert [n["name"] for n in last["results"]] == ["node-06"]
    assert last["next"] is None and last["previous"] is not None
    assert viewer.get("/api/v1/nodes/?page_size=3&page=4").status_code == 404
    assert len(viewer.get("/api/v1/nodes/?page_size=500").json()["results"]) == 7
    assert viewer.get("/api/v1/cards/").json()["next"] is None  # default 50 a page


def test_list_query_counts_do_not_grow(viewer: APIClient, monkeypatch: Any) -> None:
    from datetime import timedelta

    from controlplane.access import authentication

    # A token records its last use at most once a minute; keep that write out of the counts.
    monkeypatch.setattr(authentication, "LAST_USED_RESOLUTION", timedelta(days=1))

    def counts() -> dict[str, int]:
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        out = {}
        for url in ["/api/v1/nodes/", "/api/v1/cards/", "/api/v1/slices/", "/api/v1/bindings/"]:
            with CaptureQueriesContext(connection) as ctx:
                assert viewer.get(url).status_code == 200
            out[url] = len(ctx.captured_queries)
        return out

    make_node("n0", cards=1)
    pod("p0", "n0", gpu_container(mem=100))
    viewer.get(QUOTAS)  # the token's first use records last_used_at: keep that write out
    small = counts()
    for i in range(1, 8):
        make_node(f"n{i}", cards=3)
        for j in range(3):
            pod(f"p{i}-{j}", f"n{i}", gpu_container(mem=100), namespace=f"ns-{j}")
    assert counts() == small


# --- card modes ----------------------------------------------------------------------------------


def test_operator_sets_a_mode_the_card_answers_draining_then_cancels(
    small_cluster: None, operator: APIClient, viewer: APIClient
) -> None:
    # GPU-n1-0 holds pod a's slice; GPU-n1-1 is idle.
    idle = send(operator, "post", "/api/v1/cards/GPU-n1-1/mode/", {"mode": "exclusive"})
    assert idle.status_code == 200, idle.content
    assert {k: idle.json()[k] for k in ("uuid", "mode", "pending_mode", "draining")} == {
        "uuid": "GPU-n1-1", "mode": "exclusive", "pending_mode": "", "draining": False,
    }  # fmt: skip
    busy = send(operator, "post", "/api/v1/cards/GPU-n1-0/mode", {"mode": "mps", "reason": "x"})
    assert busy.status_code == 200, busy.content
    body = busy.json()
    assert (body["mode"], body["pending_mode"], body["draining"]) == ("shared", "mps", True)
    assert body["mode_status"] == "draining: becomes MPS when its last slice ends"
    listed = {c["uuid"]: c for c in viewer.get("/api/v1/cards/").json()["results"]}
    assert listed["GPU-n1-0"]["draining"] and listed["GPU-n1-1"]["mode"] == "exclusive"
    node_cards = viewer.get("/api/v1/nodes/n1/").json()["cards"]
    assert [c["mode_status"] for c in node_cards] == [body["mode_status"], "exclusive"]
    cancel = send(operator, "post", "/api/v1/cards/GPU-n1-0/mode", {"mode": "shared"})
    assert (cancel.json()["pending_mode"], cancel.json()["draining"]) == ("", False)
    assert list(
        AuditEvent.objects.filter(action__startswith="card-mode")
        .order_by("id")
        .values_list("actor", "action", "target")
    ) == [
        ("otto-operator", "card-mode", "GPU-n1-1"),
        ("otto-operator", "card-mode-requested", "GPU-n1-0"),
        ("otto-operator", "card-mode-cancelled", "GPU-n1-0"),
    ]


def test_admin_may_set_a_mode(small_cluster: None) -> None:
    admin = token_client("ada-admin", Role.ADMIN)
    response = send(admin, "post", "/api/v1/cards/GPU-n1-1/mode", {"mode": "mps"})
    assert response.status_code == 200 and response.json()["mode"] == "mps"


def test_a_mig_card_lists_its_instances_with_their_pods(
    small_cluster: None, viewer: APIClient
) -> None:
    from controlplane.ledger.models import Slice

    Card.objects.filter(uuid="GPU-n1-0").update(mode="mig", mig_capable=True, mig_enabled=True)
    Slice.objects.filter(card__uuid="GPU-n1-0").update(
        mig_profile="3g.40gb", mig_start=4, mig_size=4
    )
    card = viewer.get("/api/v1/cards/GPU-n1-0/").json()
    assert (card["mode"], card["mig_capable"], card["mig_enabled"]) == ("mig", True, True)
    assert card["mig_instances"] == [
        {"profile": "3g.40gb", "start": 4, "size": 4, "namespace": "team-a", "pod": "a",
         "pod_uid": card["slices"][0]["pod_uid"], "container": "c"},
    ]  # fmt: skip
    other = viewer.get("/api/v1/cards/GPU-n1-1/").json()
    assert other["mig_instances"] == [] and other["mig_capable"] is False


# --- cordons -------------------------------------------------------------------------------------


def test_operator_cordons_and_uncordons_with_audit(cluster: None, operator: APIClient) -> None:
    response = send(operator, "post", "/api/v1/nodes/n1/cordon", {"reason": "maintenance"})
    assert response.status_code == 200, response.content
    assert response.json()["cordoned"] is True
    assert Node.objects.get(name="n1").cordoned
    assert send(operator, "post", "/api/v1/nodes/n1/cordon/", {}).status_code == 200  # idempotent
    card = send(operator, "post", "/api/v1/cards/GPU-n2-0/cordon/", None)
    assert card.status_code == 200 and card.json()["cordoned"] is True
    assert Card.objects.get(uuid="GPU-n2-0").cordoned
    assert send(operator, "post", "/api/v1/cards/GPU-n2-0/uncordon", {}).json()["cordoned"] is False
    assert send(operator, "post", "/api/v1/nodes/n1/uncordon", {}).json()["cordoned"] is False
    events = list(
        AuditEvent.objects.filter(action__contains="cordon")
        .order_by("id")
        .values_list("actor", "action", "target")
    )
    assert events == [
        ("otto-operator", "node-cordon", "n1"),
        ("otto-operator", "card-cordon", "GPU-n2-0"),
        ("otto-operator", "card-uncordon", "GPU-n2-0"),
        ("otto-operator", "node-uncordon", "n1"),
    ]
    cordon = AuditEvent.objects.get(action="node-cordon")
    assert cordon.details["reason"] == "maintenance"


@pytest.mark.parametrize(
    ("url", "body", "status", "field"),
    [
        ("/api/v1/nodes/ghost/cordon", {}, 404, "name"),
        ("/api/v1/cards/GPU-ghost/cordon", {}, 404, "uuid"),
        ("/api/v1/nodes/n1/cordon", {"reason": 5}, 400, "reason"),
        ("/api/v1/nodes/n1/cordon", {"why": "x"}, 400, "why"),
        ("/api/v1/cards/GPU-n1-0/cordon", {"reason": "x" * 501}, 400, "reason"),
        # measured as sent: no trimming brings it under the limit
        ("/api/v1/nodes/n1/cordon", {"reason": "\r" + "x" * 500}, 400, "reason"),
        ("/api/v1/cards/GPU-n1-0/cordon", {"reason": "\u00a0" + "x" * 500}, 400, "reason"),
        ("/api/v1/cards/GPU-n1-0/mode", {"mode": "vgpu"}, 400, "mode"),
        ("/api/v1/cards/GPU-n1-0/mode", {"mode": "MIG"}, 400, "mode"),
        ("/api/v1/cards/GPU-n1-0/mode", {"mode": 1}, 400, "mode"),
        ("/api/v1/cards/GPU-n1-0/mode", {"mode": None}, 400, "mode"),
        ("/api/v1/cards/GPU-n1-0/mode", {}, 400, "mode"),
        ("/api/v1/cards/GPU-n1-0/mode", {"mode": "mig"}, 400, "mode"),  # not MIG-capable
        ("/api/v1/cards/GPU-n1-0/mode", {"mode": "mps", "reason": 5}, 400, "reason"),
        ("/api/v1/cards/GPU-n1-0/mode", {"mode": "mps", "reason": "x" * 501}, 400, "reason"),
        ("/api/v1/cards/GPU-n1-0/mode", {"mode": "mps", "why": "x"}, 400, "why"),
        ("/api/v1/cards/GPU-n1-0/mode", ["mps"], 400, "body"),
        ("/api/v1/cards/GPU-ghost/mode", {"mode": "mps"}, 404, "uuid"),
    ],
)
def test_bad_cordons_and_modes_change_nothing(
    cluster: None, operator: APIClient, url: str, body: Any, status: int, field: str
) -> None:
    before = ledger_snapshot()
    response = send(operator, "post", url, body)
    assert response.status_code == status, response.content
    assert field in response.json()["fields"]
    assert ledger_snapshot() == before


# --- schema and docs -----------------------------------------------------------------------------


def test_schema_lists_the_operations_api(viewer: APIClient) -> None:
    response = viewer.get("/api/schema/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200
    paths = response.json()["paths"] if response.get("Content-Type", "").endswith("json") else None
    text = response.content.decode()
    for path in ["/api/v1/quotas/", "/api/v1/quotas/{namespace}/", "/api/v1/bindings/"]:
        assert path in (paths or text)
    assert "bearerToken" in text


CORDONS = [
    "/api/v1/nodes/n1/cordon",
    "/api/v1/nodes/n1/uncordon",
    "/api/v1/cards/GPU-n1-0/cordon",
    "/api/v1/cards/GPU-n1-0/uncordon",
]


@pytest.mark.parametrize("url", CORDONS)
@pytest.mark.parametrize(
    "body", ["null", "[]", "0.0", "0", "false", "true", '""', '"maintenance"', '["reason"]']
)
def test_a_cordon_body_is_an_object_or_nothing(
    cluster: None, operator: APIClient, url: str, body: str
) -> None:
    before = ledger_snapshot()
    response = send(operator, "post", url, body, raw=True)
    assert response.status_code == 400, response.content
    payload = response.json()
    assert "JSON object" in payload["fields"]["body"]
    assert ledger_snapshot() == before


@pytest.mark.parametrize("url", CORDONS)
@pytest.mark.parametrize("body", [None, "{}", '{"reason": "disk swap"}'])
def test_no_body_or_the_documented_object_cordons(
    cluster: None, operator: APIClient, url: str, body: str | None
) -> None:
    response = send(operator, "post", url, body, raw=True)
    assert response.status_code == 200, response.content
    assert response.json()["cordoned"] is url.endswith("/cordon")


# --- memory oversubscription (docs/virtual-memory.md) ------------------------------------------

FACTOR_URL = "/api/v1/cards/{}/memory-oversubscription"


def test_operator_sets_a_card_factor_the_card_views_show_it_and_null_clears_it(
    small_cluster: None, operator: APIClient, viewer: APIClient
) -> None:
    done = send(operator, "post", FACTOR_URL.format("GPU-n1-1"), {"factor": "1.5", "reason": "nb"})
    assert done.status_code == 200, done.content
    body = done.json()
    assert (body["memory_oversubscription"], body["memory_oversubscription_own"]) == ("1.5", "1.5")
    assert body["memory_virtual_mib"] == 15000
    listed = {c["uuid"]: c for c in viewer.get("/api/v1/cards/").json()["results"]}
    assert listed["GPU-n1-0"]["memory_oversubscription"] == "1"
    assert listed["GPU-n1-0"]["memory_resident_allocated_mib"] == 3000
    assert listed["GPU-n1-1"]["memory_virtual_mib"] == 15000
    cleared = send(operator, "post", FACTOR_URL.format("GPU-n1-1") + "/", {"factor": None})
    assert cleared.status_code == 200, cleared.content
    assert cleared.json()["memory_oversubscription_own"] is None
    assert AuditEvent.objects.filter(action="card-memory-factor").count() == 2


@pytest.mark.parametrize("factor", ["0.5", "abc", "1.555", "17", 2, 1.5, True, ""])
def test_a_bad_factor_is_refused_naming_the_field_and_changes_nothing(
    small_cluster: None, operator: APIClient, factor: Any
) -> None:
    response = send(operator, "post", FACTOR_URL.format("GPU-n1-1"), {"factor": factor})
    assert response.status_code == 400, response.content
    assert "factor" in json.dumps(response.json())
    assert Card.objects.get(uuid="GPU-n1-1").memory_factor is None


def test_lowering_a_factor_below_what_is_bound_answers_409_and_changes_nothing(
    small_cluster: None, operator: APIClient
) -> None:
    # Pod a holds 3000 MiB on GPU-n1-0 (10000 MiB): factor 2, then down to 0.25 of that.
    assert send(operator, "post", FACTOR_URL.format("GPU-n1-0"), {"factor": "2"}).status_code == 200
    Card.objects.filter(uuid="GPU-n1-0").update(memory_mib=2000)  # reported smaller since
    response = send(operator, "post", FACTOR_URL.format("GPU-n1-0"), {"factor": "1.25"})
    assert response.status_code == 409, response.content
    assert "3000 MiB" in json.dumps(response.json()) and "2500 MiB" in json.dumps(response.json())
    assert Card.objects.get(uuid="GPU-n1-0").memory_factor == 200
    assert (
        send(operator, "post", FACTOR_URL.format("GPU-n1-0"), {"factor": "1.5"}).status_code == 200
    )


def test_a_viewer_may_not_set_a_factor(small_cluster: None, viewer: APIClient) -> None:
    response = send(viewer, "post", FACTOR_URL.format("GPU-n1-1"), {"factor": "2"})
    assert response.status_code == 403
    assert Card.objects.get(uuid="GPU-n1-1").memory_factor is None
