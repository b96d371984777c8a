"""The card grid page: cells, tooltips, filters, sort, colour toggle, roles and query counts."""

from __future__ import annotations

import html
import re
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from controlplane.access.roles import Role
from controlplane.dashboard import grid
from controlplane.ledger.models import Card, Node
from controlplane.ledger.services.cordons import set_card_cordon, set_node_cordon
from controlplane.ledger.services.nodes import InventoryReport, apply_inventory, set_card_factor
from tests.builders import card_report
from tests.dashboard.builders import make_node, person, pod, signed_in
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db

CELL = re.compile(r'<a class="(c [^"]*)" href="/cards/([^/"]+)/" title="([^"]*)"></a>')


@pytest.fixture
def cluster() -> None:
    make_node("n1", cards=2, memory_mib=81920)
    make_node("n2", cards=2, memory_mib=24576, model="NVIDIA L4")
    pod("train-0", "n1", gpu_container("trainer", mem=61440, cores=20), namespace="team-a")
    pod("infer-0", "n1", gpu_container("server", mem=8192, cores=90), namespace="team-b")
    pod("infer-1", "n2", gpu_container("server", mem=8192, cores=20), namespace="team-b")


def cells(client: Client, query: str = "") -> list[tuple[str, str, str]]:
    """(classes, card uuid, tooltip) of every cell, in page order."""
    response = client.get(f"/grid/{query}")
    assert response.status_code == 200
    return [(c, u, html.unescape(t)) for c, u, t in CELL.findall(response.content.decode())]


def uuids(client: Client, query: str = "") -> list[str]:
    return [u for _, u, _ in cells(client, query)]


def test_one_cell_per_card_grouped_by_node_with_its_facts(cluster: None) -> None:
    client = signed_in(Role.VIEWER)
    body = client.get("/grid/").content.decode()
    found = {u: (css, title) for css, u, title in cells(client)}
    assert sorted(found) == ["GPU-n1-0", "GPU-n1-1", "GPU-n2-0", "GPU-n2-1"]
    # grouped: each node's label, then its cells
    assert body.index('href="/nodes/n1/"') < body.index("GPU-n1-0") < body.index('"/nodes/n2/"')
    busy = next(t for u, (_, t) in found.items() if "team-a/train-0" in t)
    assert "GPU 0 \u00b7 n1" in busy or "GPU 1 \u00b7 n1" in busy
    assert "NVIDIA A100-SXM4-80GB \u00b7 shared" in busy
    assert re.search(r"memory \d+/81920 MiB", busy) and re.search(r"compute \d+/100%", busy)
    assert "no pods" in found["GPU-n2-1"][1] or "no pods" in found["GPU-n2-0"][1]
    assert "4 of 4 cards on 2 nodes" in body


def test_the_cell_colour_follows_the_allocated_share_and_the_toggle(cluster: None) -> None:
    client = signed_in(Role.VIEWER)
    trainer = next(u for _, u, t in cells(client) if "team-a/train-0" in t)
    by_memory = {u: css for css, u, _ in cells(client)}
    by_compute = {u: css for css, u, _ in cells(client, "?colour=compute")}
    assert by_memory[trainer].split()[1] == "a8"  # 75% -> the eighth step
    assert by_compute[trainer].split()[1] == "a2"  # 20% -> the second
    idle = next(u for _, u, t in cells(client) if "no pods" in t)
    assert by_memory[idle].split()[1] == "a0"


def test_a_card_that_oversubscribes_fills_against_what_its_slices_may_add_up_to(
    cluster: None,
) -> None:
    client = signed_in(Role.VIEWER)
    trainer = next(u for _, u, t in cells(client) if "team-a/train-0" in t)
    set_card_factor(trainer, "2", "alice")
    found = {u: (css, title) for css, u, title in cells(client)}
    css, title = found[trainer]
    assert css.split()[1] == "a4"  # 61440 of 2 x 81920: 37.5 %, no longer 75 %
    assert "memory 61440/163840 MiB (81920 MiB x 2)" in title
    others = [t for u, (_, t) in found.items() if u.startswith("GPU-n1") and u != trainer]
    assert all(re.search(r"memory \d+/81920 MiB \u00b7", t) for t in others)
    # free memory for the sort counts the virtual budget: the trainer's card has the most
    assert uuids(client, "?sort=free")[0] == trainer


def test_level_steps_never_draw_a_used_card_as_empty() -> None:
    assert grid._level(0) == 0
    assert grid._level(0.001) == 1
    assert grid._level(0.5) == 5
    assert grid._level(0.51) == 6
    assert grid._level(1.0) == 10
    assert grid._level(1.7) == 10


def test_filter_by_model_namespace_and_state(cluster: None) -> None:
    client = signed_in(Role.VIEWER)
    assert uuids(client, "?model=NVIDIA+L4") == ["GPU-n2-0", "GPU-n2-1"]
    team_a = uuids(client, "?namespace=team-a")
    assert len(team_a) == 1 and team_a[0].startswith("GPU-n1-")
    team_b = uuids(client, "?namespace=team-b")
    assert len(team_b) == 2 and {u[:6] for u in team_b} == {"GPU-n1", "GPU-n2"}
    assert uuids(client, "?namespace=team-b&model=NVIDIA+L4") == [
        u for u in team_b if u.startswith("GPU-n2")
    ]
    assert uuids(client, "?namespace=nobody") == []

    set_card_cordon("GPU-n1-1", True, "alice", "")
    Card.objects.filter(uuid="GPU-n2-0").update(pending_mode="mig")
    apply_inventory(
        "n3",
        InventoryReport("t", (card_report("GPU-n3-0", 0, healthy=False, health_reason="XID 79"),)),
        "test",
    )
    assert uuids(client, "?state=cordoned") == ["GPU-n1-1"]
    assert uuids(client, "?state=draining") == ["GPU-n2-0"]
    assert uuids(client, "?state=unhealthy") == ["GPU-n3-0"]
    assert uuids(client, "?state=healthy") == ["GPU-n1-0", "GPU-n2-1"]
    # a cordoned node cordons every card on it
    set_node_cordon("n2", True, "alice", "")
    assert uuids(client, "?state=cordoned") == ["GPU-n1-1", "GPU-n2-0", "GPU-n2-1"]
    assert uuids(client, "?state=healthy") == ["GPU-n1-0"]
    marks = {u: css for css, u, _ in cells(client)}
    assert "sC" in marks["GPU-n1-1"].split()
    assert "sD" in marks["GPU-n2-0"].split()  # draining outranks cordoned on the cell
    assert "sU" in marks["GPU-n3-0"].split()
    # unknown choices show everything rather than failing
    assert len(uuids(client, "?state=bogus&colour=x&sort=y")) == 5


def test_mode_and_pending_mode_are_in_the_tooltip_and_the_mark(cluster: None) -> None:
    Card.objects.filter(uuid="GPU-n2-1").update(mode="mig")
    Card.objects.filter(uuid="GPU-n2-0").update(mode="shared", pending_mode="exclusive")
    client = signed_in(Role.VIEWER)
    found = {u: (css.split(), t) for css, u, t in cells(client)}
    assert "mM" in found["GPU-n2-1"][0] and "NVIDIA L4 \u00b7 mig" in found["GPU-n2-1"][1]
    assert "shared \u2192 exclusive (draining)" in found["GPU-n2-0"][1]
    assert not {"mM", "mP", "mX"} & set(found["GPU-n1-0"][0])


def test_sort_by_free_memory(cluster: None) -> None:
    make_node("n0-empty", cards=2, memory_mib=81920)
    client = signed_in(Role.VIEWER)
    by_name = uuids(client)
    assert by_name[:2] == ["GPU-n0-empty-0", "GPU-n0-empty-1"]
    most = cells(client, "?sort=free")
    free = [int(m.group(2)) - int(m.group(1)) for m in
            (re.search(r"memory (\d+)/(\d+) MiB", t) for _, _, t in most)]  # fmt: skip
    # nodes by total free memory, most first: n0-empty (160 GiB), n1, n2
    assert [u[:6] for _, u, _ in most] == ["GPU-n0"] * 2 + ["GPU-n1"] * 2 + ["GPU-n2"] * 2
    assert free[2] >= free[3] and free[4] >= free[5]  # and cards within a node likewise
    least = [u[:6] for u in uuids(client, "?sort=-free")]
    assert least == ["GPU-n2"] * 2 + ["GPU-n1"] * 2 + ["GPU-n0"] * 2


def test_namespace_legend_gives_distinct_colours_and_filters(cluster: None) -> None:
    for i in range(6):
        pod(f"x{i}", "n2", gpu_container(mem=100, cores=1), namespace=f"extra-{i}")
    body = signed_in(Role.VIEWER).get("/grid/").content.decode()
    legend = body[body.index('class="nslegend"') :]
    looks = dict(
        (ns, css)
        for css, ns in re.findall(r'<i class="swatch (h\d) p\d"></i>([a-z0-9-]+)</a>', legend)
    )
    assert len(looks) == 8 and len(set(looks.values())) == 8  # eight namespaces, eight hues
    assert 'href="?namespace=team-a"' in legend


def test_roles_and_sign_in(cluster: None) -> None:
    anonymous = Client().get("/grid/")
    assert anonymous.status_code == 302 and anonymous["Location"].startswith("/login/")
    norole = Client()
    norole.force_login(person("nobody", None))
    assert norole.get("/grid/").status_code == 403
    assert signed_in(Role.VIEWER).get("/grid/").status_code == 200


def test_ledger_values_are_escaped() -> None:
    apply_inventory(
        "n1",
        InventoryReport("t", (card_report("GPU-n1-0", 0, model='A100 "x" <b>&'),)),
        "test",
    )
    body = signed_in(Role.VIEWER).get("/grid/").content.decode()
    assert "<b>" not in body.split('id="cardgrid"')[1]
    assert "A100 &quot;x&quot; &lt;b&gt;&amp;" in body


def grow(nodes: int) -> None:
    for i in range(nodes):
        make_node(f"more-{i}", cards=4, memory_mib=10000)
        for j in range(3):
            pod(f"m{i}-{j}", f"more-{i}", gpu_container(mem=500), namespace=f"ns-{j}")


def test_the_selector_reads_in_four_queries_whatever_the_size(
    cluster: None, django_assert_num_queries: Any
) -> None:
    with django_assert_num_queries(4):
        small = grid.card_grid(grid.GridFilters())
    grow(5)
    with django_assert_num_queries(4):
        large = grid.card_grid(grid.GridFilters(namespace="ns-1", sort="free"))
    assert small.cards_total == 4 and large.cards_total == 24
    assert large.cards_shown == 5


@pytest.mark.parametrize("query", ["", "?namespace=team-b&state=healthy&sort=free&colour=compute"])
def test_the_page_query_count_does_not_grow_with_the_cluster(cluster: None, query: str) -> None:
    client = signed_in(Role.VIEWER)
    client.get("/grid/")  # the session's first page stores its CSRF token

    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert client.get(f"/grid/{query}").status_code == 200
        return len(ctx.captured_queries)

    small = count()
    grow(8)
    assert Node.objects.count() == 10
    assert count() == small
    assert small <= 8  # session and user, then the grid's four


def test_the_tooltip_names_each_pod_once_and_caps_the_list(monkeypatch: Any) -> None:
    make_node("n1", cards=1, memory_mib=81920)
    pod(
        "with-init",
        "n1",
        gpu_container("app", mem=1024, cores=10),
        init_containers=[gpu_container("setup", mem=2048, cores=10)],
        namespace="team-a",
    )
    pod("other", "n1", gpu_container("app", mem=1024, cores=10), namespace="team-b")
    client = signed_in(Role.VIEWER)
    ((_, _, title),) = cells(client)
    assert title.endswith("\nteam-a/with-init, team-b/other")  # sorted, the init slice folded in
    monkeypatch.setattr(grid, "TOOLTIP_PODS", 1)
    ((_, _, title),) = cells(client)
    assert title.endswith("\nteam-a/with-init and 1 more")


def test_the_grid_leaves_the_garbage_collector_alone(monkeypatch: Any) -> None:
    import gc

    real = grid.card_grid
    seen: list[bool] = []

    def watched(filters: grid.GridFilters) -> grid.Grid:
        seen.append(gc.isenabled())
        return real(filters)

    monkeypatch.setattr(grid, "card_grid", watched)
    assert gc.isenabled()
    grid.build(grid.GridFilters())
    assert seen == [True] and gc.isenabled()
