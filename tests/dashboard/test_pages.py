"""Dashboard pages: sign-in, roles on every page and action, CSRF, content, live fragments."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.access.roles import Role
from controlplane.dashboard.models import AllocationSample
from controlplane.ledger.models import AuditEvent, Card, NamespaceQuota, Node
from controlplane.ledger.services import nominations
from controlplane.ledger.services.nodes import InventoryReport, apply_inventory
from controlplane.scheduling import CardClaim
from tests.builders import card_report
from tests.dashboard.builders import PASSWORD, decision, make_node, person, pod, signed_in
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db

PAGES = [
    "/",
    "/?fragment=1",
    "/nodes/",
    "/nodes/?fragment=1",
    "/nodes/n1/",
    "/grid/",
    "/cards/GPU-n1-0/",
    "/bindings/",
    "/pods/team-a/train-0/",
    "/quotas/",
    "/audit/",
    "/api/docs/",
]


@pytest.fixture
def cluster() -> None:
    make_node("n1", cards=2, memory_mib=81920)
    make_node("n2", cards=1, memory_mib=24576, model="NVIDIA L4")
    pod("train-0", "n1", gpu_container("trainer", mem=20480, cores=50), namespace="team-a")
    pod("infer-0", "n1", gpu_container("server", mem=8192, cores=20), namespace="team-b")
    pod("infer-1", "n2", gpu_container("server", mem=8192, cores=20), namespace="team-b")
    decision("queued", namespace="team-c", summary="No card has 90000 MiB free.")


def state() -> tuple[Any, ...]:
    return (
        list(NamespaceQuota.objects.values_list("namespace", "gpumem_mib", "gpucores", "gpus")),
        list(Node.objects.values_list("name", "cordoned")),
        list(Card.objects.values_list("uuid", "cordoned", "mode", "pending_mode")),
        AuditEvent.objects.count(),
    )


@pytest.mark.parametrize("url", PAGES)
def test_anonymous_is_sent_to_login(cluster: None, url: str) -> None:
    response = Client().get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


@pytest.mark.parametrize("url", PAGES)
def test_identity_without_human_role_gets_403(cluster: None, url: str) -> None:
    for client in (signed_in(None, "plain-user"), signed_in(Role.NODE, "n1")):
        response = client.get(url)
        assert response.status_code == 403
        assert b"viewer" in response.content


@pytest.mark.parametrize("url", PAGES)
def test_viewer_sees_every_page(cluster: None, url: str) -> None:
    response = signed_in(Role.VIEWER).get(url)
    assert response.status_code == 200, url
    assert b"<html" in response.content or url.endswith("fragment=1")


def test_login_and_logout() -> None:
    person("vera", Role.VIEWER)
    client = Client(enforce_csrf_checks=True)
    page = client.get("/login/")
    assert page.status_code == 200 and b'name="password"' in page.content
    assert "csrftoken" not in page.cookies  # the token lives in the session, not a cookie
    token = form_token(page)
    bad = client.post(
        "/login/", {"username": "vera", "password": "nope", "csrfmiddlewaretoken": token}
    )
    assert bad.status_code == 200 and b"didn't match" in bad.content
    ok = client.post(
        "/login/",
        {"username": "vera", "password": PASSWORD, "csrfmiddlewaretoken": token, "next": "/nodes/"},
    )
    assert ok.status_code == 302 and ok["Location"] == "/nodes/"
    assert client.get("/nodes/").status_code == 200
    assert client.get("/logout/").status_code == 405  # logout is a POST
    out = client.post("/logout/", {"csrfmiddlewaretoken": form_token(client.get("/nodes/"))})
    assert out.status_code == 302
    assert client.get("/nodes/").status_code == 302


def form_token(response: Any) -> str:
    """The CSRF token a page's forms carry."""
    found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', response.content.decode())
    assert found, "no form with a CSRF token on the page"
    return found.group(1)


def test_the_csrf_token_belongs_to_the_session() -> None:
    """CSRF_USE_SESSIONS: a token is good only in the session it was issued to, and signing in
    replaces it, so neither a planted cookie nor a token taken before sign-in gets a form in."""
    person("vera", Role.VIEWER)
    mine, theirs = Client(enforce_csrf_checks=True), Client(enforce_csrf_checks=True)
    mine_token = form_token(mine.get("/login/"))
    their_token = form_token(theirs.get("/login/"))
    credentials = {"username": "vera", "password": PASSWORD}
    refused = mine.post("/login/", {**credentials, "csrfmiddlewaretoken": their_token})
    assert refused.status_code == 403  # another session's token
    mine.cookies["csrftoken"] = their_token  # a cookie is not where the token is looked for
    refused = mine.post("/login/", {**credentials, "csrfmiddlewaretoken": their_token})
    assert refused.status_code == 403
    signed = mine.post("/login/", {**credentials, "csrfmiddlewaretoken": mine_token})
    assert signed.status_code == 302
    stale = mine.post("/logout/", {"csrfmiddlewaretoken": mine_token})
    assert stale.status_code == 403  # rotated at sign-in
    fresh = form_token(mine.get("/nodes/"))
    assert fresh != mine_token
    assert mine.post("/logout/", {"csrfmiddlewaretoken": fresh}).status_code == 302


def test_overview_figures(cluster: None) -> None:
    body = signed_in(Role.VIEWER).get("/").content.decode()
    assert re.search(r'data-stat="cards">\s*3<', body)
    assert re.search(r'data-stat="slices">\s*3<', body)
    assert re.search(r'data-stat="pending">\s*1<', body)
    assert "36 GiB of 184 GiB" in body  # 20480+8192+8192 MiB of 2x80 GiB + 24 GiB
    assert "team-c/queued" in body and "No card has 90000 MiB free." in body
    assert 'hx-trigger="every 5s"' in body
    assert "<svg" in body and "Allocation over the last 6 hours" in body


def test_overview_records_one_sample_a_minute(cluster: None, monkeypatch: Any) -> None:
    from datetime import timedelta

    from django.utils import timezone

    client = signed_in(Role.VIEWER)
    start = timezone.now().replace(second=5)
    monkeypatch.setattr(timezone, "now", lambda: start)  # no minute boundary mid-test
    client.get("/")
    client.get("/?fragment=1")
    assert AllocationSample.objects.count() == 1
    monkeypatch.setattr(timezone, "now", lambda: start + timedelta(minutes=1))
    client.get("/?fragment=1")
    assert AllocationSample.objects.count() == 2
    monkeypatch.setattr(timezone, "now", lambda: start)
    assert AllocationSample.objects.order_by("bucket").first().memory_allocated_mib == 36864


def test_live_fragment_is_only_the_live_part(cluster: None) -> None:
    client = signed_in(Role.VIEWER)
    fragment = client.get("/?fragment=1").content.decode()
    assert fragment.lstrip().startswith('<div id="overview-live"')
    assert "<html" not in fragment
    pod("late", "n2", gpu_container(mem=1024), namespace="team-d")
    assert re.search(r'data-stat="slices">\s*4<', client.get("/?fragment=1").content.decode())


def test_nodes_page_draws_cards_split_into_slices(cluster: None) -> None:
    body = signed_in(Role.VIEWER).get("/nodes/").content.decode()
    n1 = body[body.index('data-node="n1"') : body.index('data-node="n2"')]
    assert n1.count('class="cardrow') == 2
    assert 'data-pod="team-a/train-0"' in n1 and 'data-pod="team-b/infer-0"' in n1
    assert "team-a/train-0 · container trainer · 20480 MiB · 50%" in n1
    assert re.search(r'data-width="25\.0" data-pod="team-a/train-0"', n1)  # 20480/81920
    assert "NVIDIA L4" in body


def test_nodes_page_paginates_50_and_filters() -> None:
    for i in range(53):
        apply_inventory(
            f"node-{i:03d}",
            InventoryReport("t", (card_report(f"GPU-{i}"),)),
            "test",
        )
    client = signed_in(Role.VIEWER)
    first = client.get("/nodes/").content.decode()
    assert first.count('class="node panel') == 50 and "page 1 of 2" in first
    second = client.get("/nodes/?page=2").content.decode()
    assert second.count('class="node panel') == 3
    only = client.get("/nodes/?q=node-007").content.decode()
    assert only.count('class="node panel') == 1
    Card.objects.filter(uuid="GPU-9").update(healthy=False)
    unhealthy = client.get("/nodes/?state=unhealthy").content.decode()
    assert unhealthy.count('class="node panel') == 1 and 'data-node="node-009"' in unhealthy


def test_card_page_shows_slices_and_health_history(cluster: None) -> None:
    apply_inventory(
        "n1",
        InventoryReport(
            "t",
            (
                card_report("GPU-n1-0", 0, healthy=False, health_reason="XID 79: fell off the bus"),
                card_report("GPU-n1-1", 1),
            ),
        ),
        "n1",
    )
    body = signed_in(Role.VIEWER).get("/cards/GPU-n1-0/").content.decode()
    assert "XID 79: fell off the bus" in body
    assert "unhealthy" in body
    assert "/pods/team-a/train-0/" in body or "/pods/team-b/infer-0/" in body
    assert signed_in(Role.VIEWER, "v2").get("/cards/GPU-none/").status_code == 404


def test_viewer_sees_no_controls_and_cannot_post(cluster: None) -> None:
    client = signed_in(Role.VIEWER)
    assert b"Cordon card" not in client.get("/cards/GPU-n1-0/").content
    assert b"Cordon node" not in client.get("/nodes/n1/").content
    quotas = client.get("/quotas/").content
    assert b"Save quota" not in quotas and b"quota-form" not in quotas
    before = state()
    assert client.post("/quotas/", {"namespace": "team-a", "gpus": "1"}).status_code == 403
    assert client.post("/quotas/", {"action": "delete", "namespace": "x"}).status_code == 403
    assert client.post("/cards/GPU-n1-0/cordon/", {"action": "cordon"}).status_code == 403
    assert client.post("/nodes/n1/cordon/", {"action": "cordon"}).status_code == 403
    assert b"card-mode-form" not in client.get("/cards/GPU-n1-0/").content
    assert client.post("/cards/GPU-n1-0/mode/", {"mode": "mps"}).status_code == 403
    assert state() == before


def busy_card() -> str:
    """The n1 card that holds team-a's train-0."""
    return Card.objects.filter(slices__binding__name="train-0").values_list("uuid", flat=True).get()


def test_operator_sets_a_mode_and_the_pages_say_draining(cluster: None) -> None:
    uuid = busy_card()
    client = signed_in(Role.OPERATOR, "otto")
    assert b"card-mode-form" in client.get(f"/cards/{uuid}/").content
    response = client.post(f"/cards/{uuid}/mode/", {"mode": "mps", "reason": "MPS trial"})
    assert response.status_code == 302 and response["Location"] == f"/cards/{uuid}/"
    assert Card.objects.filter(uuid=uuid).values_list("mode", "pending_mode").get() == (
        "shared", "mps",
    )  # fmt: skip
    page = client.get(f"/cards/{uuid}/", follow=True).content.decode()
    assert "becomes MPS when its last slice ends" in page
    assert "Draining: the card becomes mps when its slices end." in page  # the flash message
    assert "mode requested" in page and "MPS trial" in page  # the history
    node_page = client.get("/nodes/n1/").content.decode()
    row = node_page[node_page.index(f'data-card="{uuid}"') :].split('class="bars"')[0]
    assert "draining" in row
    client.post(f"/cards/{uuid}/mode/", {"mode": "shared"})  # cancels
    assert Card.objects.get(uuid=uuid).pending_mode == ""
    assert list(
        AuditEvent.objects.filter(action__startswith="card-mode")
        .order_by("id")
        .values_list("actor", "action")
    ) == [("otto", "card-mode-requested"), ("otto", "card-mode-cancelled")]


def test_an_idle_card_changes_at_once_and_the_node_page_shows_it(cluster: None) -> None:
    make_node("n3", cards=1)
    idle = "GPU-n3-0"
    client = signed_in(Role.OPERATOR, "otto")
    client.post(f"/cards/{idle}/mode/", {"mode": "exclusive"})
    assert Card.objects.get(uuid=idle).mode == "exclusive"
    node_page = client.get("/nodes/n3/").content.decode()
    row = node_page[node_page.index(f'data-card="{idle}"') :].split('class="bars"')[0]
    assert 'class="badge mode-exclusive"' in row


@pytest.mark.parametrize("mode", ["mig", "vgpu", ""])
def test_a_refused_mode_says_why_and_changes_nothing(cluster: None, mode: str) -> None:
    client = signed_in(Role.OPERATOR, "otto")
    before = state()
    page = client.post("/cards/GPU-n1-0/mode/", {"mode": mode}, follow=True).content.decode()
    assert "not reported MIG-capable" in page if mode == "mig" else "Choose a mode" in page
    assert state() == before


def test_a_mig_card_shows_its_layout_and_each_instance_s_pod(cluster: None) -> None:
    from controlplane.ledger.models import Slice

    uuid = busy_card()
    Card.objects.filter(uuid=uuid).update(mode="mig", mig_capable=True, mig_enabled=True)
    Slice.objects.filter(card__uuid=uuid).update(mig_profile="3g.40gb", mig_start=4, mig_size=4)
    page = signed_in(Role.VIEWER).get(f"/cards/{uuid}/").content.decode()
    layout = page[page.index('id="mig-layout"') :].split("</section>")[0]
    # free slices 0-3, then the instance at 4-7: half the bar each
    cells = re.findall(r'<span class="seg ([^"]*)" data-width="([\d.]+)"', layout)
    assert [(css.startswith("migfree"), width) for css, width in cells] == [
        (True, "50.0"), (False, "50.0"),
    ]  # fmt: skip
    assert 'data-mig="3g.40gb"' in layout and "team-a/train-0" in layout
    assert "capable · on" in page
    other = signed_in(Role.VIEWER, "v2").get("/cards/GPU-n2-0/").content.decode()
    assert 'id="mig-layout"' not in other


def test_operator_cordons_card_and_node(cluster: None) -> None:
    client = signed_in(Role.OPERATOR, "otto")
    page = client.get("/cards/GPU-n1-0/").content
    assert b"Cordon card" in page
    response = client.post(
        "/cards/GPU-n1-0/cordon/", {"action": "cordon", "reason": "ECC errors", "next": "/nodes/"}
    )
    assert response.status_code == 302 and response["Location"] == "/nodes/"
    assert Card.objects.get(uuid="GPU-n1-0").cordoned
    assert b"Uncordon card" in client.get("/cards/GPU-n1-0/").content
    client.post("/nodes/n1/cordon/", {"action": "cordon", "next": "https://evil.example/"})
    assert Node.objects.get(name="n1").cordoned
    client.post("/nodes/n1/cordon/", {"action": "uncordon"})
    assert not Node.objects.get(name="n1").cordoned
    events = list(
        AuditEvent.objects.filter(action__contains="cordon")
        .order_by("id")
        .values_list("actor", "action")
    )
    assert events == [("otto", "card-cordon"), ("otto", "node-cordon"), ("otto", "node-uncordon")]
    history = client.get("/cards/GPU-n1-0/").content.decode()
    assert "cordon" in history and "ECC errors" in history


def test_unsafe_next_is_ignored(cluster: None) -> None:
    client = signed_in(Role.OPERATOR)
    response = client.post(
        "/nodes/n1/cordon/", {"action": "cordon", "next": "https://evil.example/"}
    )
    assert response["Location"] == "/nodes/n1/"


def test_forms_need_csrf(cluster: None) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(person("olga", Role.OPERATOR))
    before = state()
    assert client.post("/quotas/", {"namespace": "team-a", "gpus": "1"}).status_code == 403
    assert client.post("/cards/GPU-n1-0/cordon/", {"action": "cordon"}).status_code == 403
    assert client.post("/cards/GPU-n1-0/mode/", {"mode": "mps"}).status_code == 403
    assert state() == before


def test_operator_edits_quotas(cluster: None) -> None:
    client = signed_in(Role.OPERATOR, "otto")
    ok = client.post(
        "/quotas/", {"namespace": "team-a", "gpumem_mib": "40960", "gpucores": "", "gpus": "4"}
    )
    assert ok.status_code == 302
    assert list(
        NamespaceQuota.objects.values_list("namespace", "gpumem_mib", "gpucores", "gpus")
    ) == [("team-a", 40960, None, 4)]
    page = client.get("/quotas/").content.decode()
    row = page[page.index('data-namespace="team-a"') :]
    row = row.split("</tr>")[0]
    assert "20 GiB / 40 GiB" in row and "50%" in row  # usage against the limit
    assert "1 / 4" in row
    assert 'data-namespace="team-b"' in page  # usage without a quota is listed too
    for bad, field in [
        ({"namespace": "Team_A", "gpus": "1"}, "namespace"),
        ({"namespace": "team-a", "gpus": "-1"}, "gpus"),
        ({"namespace": "team-a", "gpumem_mib": "lots"}, "gpumem_mib"),
    ]:
        before = state()
        response = client.post("/quotas/", bad)
        assert response.status_code == 400
        assert f'data-error-for="{field}"' in response.content.decode()
        assert state() == before
    client.post("/quotas/", {"action": "delete", "namespace": "team-a"})
    assert not NamespaceQuota.objects.exists()
    assert list(AuditEvent.objects.filter(target_type="quota").values_list("actor", flat=True)) == [
        "otto",
        "otto",
    ]


def test_bindings_search_filter_sort_and_paginate(cluster: None) -> None:
    make_node("n3", cards=8, memory_mib=10000)
    for i in range(55):
        pod(f"batch-{i:02d}", "n3", gpu_container(mem=10), namespace="team-e")
    client = signed_in(Role.VIEWER)

    def names(query: str) -> list[str]:
        body = client.get(f"/bindings/{query}").content.decode()
        return re.findall(r'data-binding="([^"]+)"', body)

    assert names("?namespace=team-b&sort=pod") == ["team-b/infer-0", "team-b/infer-1"]
    assert names("?q=train") == ["team-a/train-0"]
    assert names("?node=n1&sort=-pod") == ["team-a/train-0", "team-b/infer-0"]
    assert names("?card=GPU-n2-0&namespace=team-b") == ["team-b/infer-1"]
    assert names("?phase=released") == []
    page1 = names("?namespace=team-e&sort=pod")
    assert len(page1) == 50 and page1[0] == "team-e/batch-00"
    assert names("?namespace=team-e&sort=pod&page=2") == [
        f"team-e/batch-{i}" for i in range(50, 55)
    ]
    body = client.get("/bindings/?namespace=team-e&sort=pod").content.decode()
    assert "page 1 of 2" in body and "sort=-pod" in body  # header link flips direction


def test_pod_page_explains_pending(cluster: None) -> None:
    client = signed_in(Role.VIEWER)
    queued = client.get("/pods/team-c/queued/").content.decode()
    assert "Pending: No card has 90000 MiB free." in queued
    running = client.get("/pods/team-a/train-0/").content.decode()
    assert "Not pending" in running and "trainer" in running and "20480 MiB" in running
    assert client.get("/pods/team-z/ghost/").status_code == 404


def test_audit_page_filters(cluster: None) -> None:
    AuditEvent.objects.create(actor="ann", action="quota-set", target_type="quota", target="t-1")
    client = signed_in(Role.VIEWER)
    body = client.get("/audit/?action=quota-set").content.decode()
    assert "t-1" in body and "node-registered" not in body.split("<tbody>")[1]
    assert "t-1" not in client.get("/audit/?target=n1").content.decode().split("<tbody>")[1]
    assert "ann" in client.get("/audit/?actor=an").content.decode()


def test_api_docs_lists_operations(cluster: None) -> None:
    body = signed_in(Role.VIEWER).get("/api/docs/").content.decode()
    assert "/api/v1/quotas/{namespace}/" in body and "PATCH" in body
    assert "/api/v1/bindings/" in body


def test_page_query_counts_do_not_grow(cluster: None, monkeypatch: Any) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from controlplane.dashboard import services

    client = signed_in(Role.VIEWER)
    urls = ["/", "/nodes/", "/bindings/", "/quotas/", "/audit/", "/cards/GPU-n1-0/"]
    # The first view of each minute also writes a sample: keep that write out of the counts.
    monkeypatch.setattr(services, "sample_due", lambda *args, **kwargs: False)

    def counts() -> list[int]:
        out = []
        for url in urls:
            with CaptureQueriesContext(connection) as ctx:
                client.get(url)
            out.append(len(ctx.captured_queries))
        return out

    client.get("/")  # the session's first page stores its CSRF token: not a per-page cost
    small = counts()
    for i in range(6):
        make_node(f"more-{i}", cards=4, memory_mib=10000)
        for j in range(4):
            pod(f"m{i}-{j}", f"more-{i}", gpu_container(mem=500), namespace=f"ns-{j}")
        decision(f"w{i}", namespace="team-c")
    assert counts() == small


def test_expired_session_poll_sends_the_tab_to_login(cluster: None) -> None:
    response = Client().get(
        "/?fragment=1", HTTP_HX_REQUEST="true", HTTP_HX_CURRENT_URL="http://testserver/nodes/"
    )
    assert response.status_code == 204
    assert response["HX-Redirect"].startswith("/login/?next=")
    assert "nodes" in response["HX-Redirect"]


def test_access_page_is_for_admins_only(cluster: None) -> None:
    for role in (Role.VIEWER, Role.OPERATOR):
        client = signed_in(role)
        assert client.get("/access/").status_code == 403
        response = client.post("/access/", {"username": "eve", "role": "admin"})
        assert response.status_code == 403
    assert not AuditEvent.objects.filter(action="role-grant").exists()
    from django.contrib.auth import get_user_model

    assert not get_user_model().objects.filter(username="eve").exists()
    assert b"Access" not in signed_in(Role.OPERATOR, "op2").get("/").content.split(b"</nav>")[0]


def test_admin_grants_roles_issues_and_revokes_tokens(cluster: None) -> None:
    from django.contrib.auth import get_user_model

    from controlplane.access.models import ApiToken
    from controlplane.access.roles import role_of

    client = signed_in(Role.ADMIN, "root")
    assert client.get("/access/").status_code == 200
    assert client.post("/access/", {"username": "pat", "role": "operator"}).status_code == 200
    assert role_of(get_user_model().objects.get(username="pat")).value == "operator"
    issued = client.post(
        "/access/",
        {"username": "prometheus", "role": "viewer", "token_label": "scrape", "issue_token": "on"},
    )
    assert issued["Cache-Control"] == "no-store"
    token = re.search(r'id="new-token">(tsr_[^<]+)<', issued.content.decode()).group(1)
    from rest_framework.test import APIClient

    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert api.get("/metrics").status_code == 200
    row = ApiToken.objects.get(user__username="prometheus")
    assert client.post("/access/", {"action": "revoke", "token": str(row.pk)}).status_code == 302
    assert api.get("/metrics").status_code == 401
    assert b"tsr_" not in client.get("/access/").content.split(b'id="tokens"')[0]  # shown once
    actions = list(AuditEvent.objects.filter(actor="root").values_list("action", flat=True))
    assert sorted(actions) == ["role-grant", "token-create", "token-revoke"]
    assert token not in str(list(AuditEvent.objects.values_list("details", flat=True)))
    for junk in ["²", "٣", "9" * 5000, "-1", ""]:  # not token ids: refused, never a 500
        refused = client.post("/access/", {"action": "revoke", "token": junk}, follow=True)
        assert refused.status_code == 200 and b"no API token" in refused.content
    bad = client.post("/access/", {"username": "bad name!", "role": "viewer"})
    assert bad.status_code == 400 and b'data-error-for="username"' in bad.content


def test_room_held_for_preemption_is_listed_on_the_overview_and_its_node(cluster: None) -> None:
    client = signed_in(Role.VIEWER)
    assert "Room held for preemption" not in client.get("/").content.decode()

    def hold(name: str, until: timedelta) -> None:
        nominations.nominate(
            pod_uid=f"uid-{name}", namespace="ml", name=name, node_name="n1", priority=1000,
            claims={"GPU-n1-0": CardClaim(40000, 0, 1, False),
                    "GPU-n1-1": CardClaim(20000, 0, 1, False)},
            victims=["team-a/train-0", "team-b/old"], deadline=timezone.now() + until,
        )  # fmt: skip

    hold("urgent", timedelta(minutes=2))
    hold("expired", -timedelta(seconds=1))  # its deadline passed: no room is held for it
    for url in ("/?fragment=1", "/nodes/n1/?fragment=1"):
        body = client.get(url).content.decode()
        rows = re.findall(r'<tr data-hold="([^"]+)">(.*?)</tr>', body, re.S)
        assert [r[0] for r in rows] == ["ml/urgent"], url
        row = rows[0][1]
        assert "team-a/train-0, team-b/old" in row and "1000" in row, url
        assert "58.6 GiB on 2 cards" in row, url  # 60,000 MiB in all
    assert "Room held for preemption" not in client.get("/nodes/n2/").content.decode()


# --- virtual device memory (docs/virtual-memory.md) ---------------------------------------------


def test_operator_sets_a_card_factor_on_its_page_and_the_page_shows_it(cluster: None) -> None:
    uuid = busy_card()
    client = signed_in(Role.OPERATOR, "otto")
    page = client.get(f"/cards/{uuid}/").content.decode()
    assert "card-factor-form" in page and "Oversubscription</dt>" not in page  # factor 1: quiet
    response = client.post(
        f"/cards/{uuid}/memory-oversubscription/", {"factor": "1.5", "reason": "notebooks"}
    )
    assert response.status_code == 302 and response["Location"] == f"/cards/{uuid}/"
    assert Card.objects.get(uuid=uuid).memory_factor == 150
    page = client.get(f"/cards/{uuid}/", follow=True).content.decode()
    assert 'data-factor="1.5"' in page and "(the card's own)" in page
    assert "Memory oversubscription x1.5 (its own)." in page  # the flash message
    assert "oversubscription</span> \u00d7node" in page and "notebooks" in page  # the history
    client.post(f"/cards/{uuid}/memory-oversubscription/", {"factor": ""})  # back to the node's
    assert Card.objects.get(uuid=uuid).memory_factor is None


@pytest.mark.parametrize("factor", ["0.5", "x", "17"])
def test_a_refused_factor_says_why_and_changes_nothing(cluster: None, factor: str) -> None:
    client = signed_in(Role.OPERATOR, "otto")
    before = state()
    url = "/cards/GPU-n1-0/memory-oversubscription/"
    page = client.post(url, {"factor": factor}, follow=True).content.decode()
    assert "from &quot;1&quot; to &quot;16&quot;" in page or 'from "1" to "16"' in page
    assert state() == before and Card.objects.get(uuid="GPU-n1-0").memory_factor is None


def test_a_viewer_may_not_set_a_factor(cluster: None) -> None:
    client = signed_in(Role.VIEWER)
    response = client.post("/cards/GPU-n1-0/memory-oversubscription/", {"factor": "2"})
    assert response.status_code == 403
    assert Card.objects.get(uuid="GPU-n1-0").memory_factor is None


def test_a_card_with_slices_that_spill_shows_resident_and_spilled(cluster: None) -> None:
    from controlplane.ledger.models import Slice

    uuid = busy_card()
    Card.objects.filter(uuid=uuid).update(memory_factor=200)
    piece = Slice.objects.filter(card__uuid=uuid, binding__name="train-0").first()
    assert piece is not None
    Slice.objects.filter(pk=piece.pk).update(resident_mib=piece.memory_mib // 2)
    node = Node.objects.get(name="n1")
    node.usage = [
        {"namespace": "team-a", "pod": "train-0", "container": piece.container_name,
         "card": uuid, "memory_used_mib": 100, "compute_used_percent": None,
         "memory_resident_mib": 60, "memory_spilled_mib": 40},
    ]  # fmt: skip
    node.usage_at = timezone.now()
    node.save(update_fields=["usage", "usage_at"])
    page = signed_in(Role.VIEWER).get(f"/cards/{uuid}/").content.decode()
    assert '<th class="num">Resident</th>' in page and '<th class="num">Spilled</th>' in page
    assert f"60 / {piece.memory_mib // 2} MiB" in page and "40 MiB" in page
    assert "Oversubscription</dt>" in page and "\u00d72" in page
