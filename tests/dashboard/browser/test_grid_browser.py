"""The card grid in a real browser at 1,000 nodes x 8 cards: cells, filters, sort, no-JS use."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from controlplane.access.roles import Role
from controlplane.ledger.models import Card, Node, PodBinding, Slice
from tests.dashboard.browser.test_dashboard_browser import sign_in
from tests.dashboard.builders import person

pytestmark = pytest.mark.django_db(transaction=True)

NODES, CARDS, MEMORY = 1000, 8, 81920
L4 = "NVIDIA L4"


def big_cluster(slices: int = 12_000, seed: int = 3) -> dict[str, Any]:
    """1,000 nodes x 8 cards written in bulk (the services would take minutes), half of them
    L4s, a few cards cordoned, draining or unhealthy, `slices` active slices in 10 namespaces.
    Returns what the checks expect, worked out here from the rows written, not from the page."""
    rng = random.Random(seed)
    Node.objects.bulk_create(Node(name=f"gpu-{i:04d}") for i in range(NODES))
    node_ids = dict(Node.objects.values_list("name", "id"))
    cards = []
    for name, node_id in sorted(node_ids.items()):
        n = int(name[4:])
        for c in range(CARDS):
            cards.append(
                Card(
                    node_id=node_id,
                    uuid=f"GPU-{name}-{c}",
                    index=c,
                    model=L4 if n >= NODES // 2 else "NVIDIA A100-SXM4-80GB",
                    memory_mib=MEMORY,
                    slots=10,
                    healthy=not (n % 97 == 5 and c == 1),
                    cordoned=n % 89 == 3 and c == 2,
                    pending_mode="mig" if n % 83 == 7 and c == 0 else "",
                    mode="mig" if c == 7 and n % 10 == 0 else "shared",
                )
            )
    Card.objects.bulk_create(cards, batch_size=2000)
    card_ids = list(Card.objects.values_list("id", "uuid", "node_id"))
    bindings, plan = [], []
    for i in range(slices):
        card_id, uuid, node_id = card_ids[rng.randrange(len(card_ids))]
        bindings.append(
            PodBinding(
                pod_uid=f"u{i}",
                namespace=f"team-{i % 10}",
                name=f"job-{i}",
                node_id=node_id,
                phase="bound",
                request={},
            )
        )
        plan.append((card_id, uuid, rng.choice([1024, 2048, 4096])))
    PodBinding.objects.bulk_create(bindings, batch_size=2000)
    ids = dict(PodBinding.objects.values_list("pod_uid", "id"))
    Slice.objects.bulk_create(
        (
            Slice(
                binding_id=ids[b.pod_uid],
                card_id=card_id,
                container_name="main",
                container_index=0,
                memory_mib=mem,
                compute_percent=5,
            )
            for b, (card_id, _, mem) in zip(bindings, plan, strict=True)
        ),
        batch_size=5000,
    )
    used: dict[str, int] = defaultdict(int)
    team3: set[str] = set()
    for b, (_, uuid, mem) in zip(bindings, plan, strict=True):
        used[uuid] += mem
        if b.namespace == "team-3":
            team3.add(uuid)
    node_free = {
        name: sum(MEMORY - used[f"GPU-{name}-{c}"] for c in range(CARDS)) for name in node_ids
    }
    return {
        "team3": team3,
        "draining": {c.uuid for c in cards if c.pending_mode},
        "most_free": min(node_free, key=lambda n: (-node_free[n], n)),
        "least_free": min(node_free, key=lambda n: (node_free[n], n)),
    }


def cell_uuids(page: Any) -> list[str]:
    return page.eval_on_selector_all(
        "#cardgrid a.c", "cells => cells.map(a => a.getAttribute('href').split('/')[2])"
    )


def test_grid_of_8000_cards_filters_and_sorts(
    page: Any, live_server: Any, screenshot_dir: Path
) -> None:
    expected = big_cluster()
    person("vera", Role.VIEWER)
    sign_in(page, live_server.url, "vera", "/grid/")
    assert page.locator("#cardgrid a.c").count() == NODES * CARDS
    assert page.locator("#cardgrid .gn").count() == NODES
    assert "8000 of 8000 cards on 1000 nodes" in page.inner_text("#grid-count")
    title = page.get_attribute('a.c[href="/cards/GPU-gpu-0500-6/"]', "title")
    assert title.startswith("GPU 6 \u00b7 gpu-0500\nNVIDIA L4 \u00b7 shared\nmemory ")
    assert "/81920 MiB" in title and "compute " in title
    page.screenshot(path=str(screenshot_dir / "grid.png"), full_page=False)

    # filters apply as soon as they are chosen (the script submits the form)
    page.select_option("select[name=model]", L4)
    page.wait_for_url("**model=NVIDIA+L4**")
    uuids = cell_uuids(page)
    assert len(uuids) == NODES * CARDS // 2
    assert all(int(u.split("-")[2]) >= NODES // 2 for u in uuids)
    page.goto(f"{live_server.url}/grid/")
    page.select_option("select[name=namespace]", "team-3")
    page.wait_for_url("**namespace=team-3**")
    assert set(cell_uuids(page)) == expected["team3"]
    page.screenshot(path=str(screenshot_dir / "grid-namespace.png"), full_page=False)
    page.goto(f"{live_server.url}/grid/")
    page.select_option("select[name=state]", "draining")
    page.wait_for_url("**state=draining**")
    assert set(cell_uuids(page)) == expected["draining"]
    assert page.locator("#cardgrid a.c.sD").count() == len(expected["draining"])

    # sort: the node with the most free memory first, the least last
    page.goto(f"{live_server.url}/grid/")
    page.select_option("select[name=sort]", "free")
    page.wait_for_url("**sort=free**")
    labels = page.eval_on_selector_all("#cardgrid .gl", "ls => ls.map(l => l.textContent)")
    assert labels[0] == expected["most_free"] and labels[-1] == expected["least_free"]
    page.screenshot(path=str(screenshot_dir / "grid-sorted.png"), full_page=False)

    # a cell leads to its card's page
    page.click('a.c[href="/cards/GPU-gpu-0001-0/"]')
    page.wait_for_url("**/cards/GPU-gpu-0001-0/")


def test_grid_reads_and_filters_without_javascript(
    browser: Any, live_server: Any, screenshot_dir: Path
) -> None:
    expected = big_cluster(slices=2000)
    person("vera", Role.VIEWER)
    context = browser.new_context(
        java_script_enabled=False, viewport={"width": 1440, "height": 900}
    )
    page = context.new_page()
    try:
        sign_in(page, live_server.url, "vera", "/grid/?state=draining")
        assert set(cell_uuids(page)) == expected["draining"]
        page.select_option("select[name=state]", "")
        page.select_option("select[name=namespace]", "team-3")
        page.click("form.filters button[type=submit]")
        page.wait_for_url("**namespace=team-3**")
        assert set(cell_uuids(page)) == expected["team3"]
    finally:
        context.close()
