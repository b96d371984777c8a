"""DRA mode: a ResourceClaim's row shows on every surface as an extender binding does, named as
a claim: the grid, the card, overview and claim pages, the operations API, the allocations API
and /metrics."""

from __future__ import annotations

import html

import pytest

from controlplane.access.roles import Role
from controlplane.ledger.services.claims import ClaimRecord, ClaimSlice, mirror_claim
from tests.builders import token_client
from tests.dashboard.builders import make_node, pod, signed_in
from tests.dashboard.test_grid import cells
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db

CLAIM = "train-gpu-x7k2p"


@pytest.fixture
def cluster() -> None:
    make_node("n1", cards=2, memory_mib=81920)
    pod("infer-0", "n1", gpu_container("server", mem=8192, cores=20), namespace="team-b")
    slices = (ClaimSlice("GPU-n1-1", "gpu", 0, 4096, 30),)
    mirror_claim(ClaimRecord("uid-claim", "team-a", CLAIM, "n1", slices), "reconciler")


def test_the_grid_names_the_claim_on_its_card_and_filters_it_by_namespace(cluster: None) -> None:
    client = signed_in(Role.VIEWER)
    found = {u: title for _, u, title in cells(client)}
    assert f"team-a/{CLAIM} (claim)" in found["GPU-n1-1"]
    assert "(claim)" not in found["GPU-n1-0"]
    assert [u for _, u, _ in cells(client, "?namespace=team-a")] == ["GPU-n1-1"]


def test_the_card_page_and_the_claim_page_say_claim(cluster: None) -> None:
    client = signed_in(Role.VIEWER)
    card = html.unescape(client.get("/cards/GPU-n1-1/").content.decode())
    assert f"claim team-a/{CLAIM}" in card
    page = client.get(f"/pods/team-a/{CLAIM}/")
    assert page.status_code == 200
    body = html.unescape(page.content.decode())
    assert f"ResourceClaim</span> team-a/{CLAIM}" in body and "GPU-n1-1" in body


def test_the_overview_counts_the_claims_slice(cluster: None) -> None:
    body = signed_in(Role.VIEWER).get("/").content.decode()
    assert 'data-stat="slices">2<' in body.replace(" ", "")


def test_the_operations_api_gives_each_row_its_source(cluster: None) -> None:
    viewer = token_client("vera", Role.VIEWER)
    rows = viewer.get("/api/v1/slices/?namespace=team-a").json()["results"]
    assert [(r["pod"], r["container"], r["card"], r["source"]) for r in rows] == [
        (CLAIM, "gpu", "GPU-n1-1", "claim")
    ]
    bindings = {b["name"]: b for b in viewer.get("/api/v1/bindings/").json()["results"]}
    assert bindings[CLAIM]["source"] == "claim" and bindings["infer-0"]["source"] == "pod"
    assert bindings[CLAIM]["slices"][0]["memory_mib"] == 4096
    card = viewer.get("/api/v1/cards/GPU-n1-1/").json()
    assert card["memory_allocated_mib"] == 4096
    assert [s["source"] for s in card["slices"]] == ["claim"]


def test_the_allocations_api_answers_the_claims_record(cluster: None) -> None:
    path = f"/api/v1/allocations/team-a/{CLAIM}"
    record = token_client("vera", Role.VIEWER).get(path)
    assert record.status_code == 200
    body = record.json()
    assert (body["pod_uid"], body["node"]) == ("uid-claim", "n1")
    (container,) = body["containers"]
    assert container["name"] == "gpu"
    assert [(d["uuid"], d["memory_mib"], d["cores"]) for d in container["devices"]] == [
        ("GPU-n1-1", 4096, 30)
    ]
    assert token_client("n1", Role.NODE).get(path).status_code == 200
    make_node("n2", cards=1)
    assert token_client("n2", Role.NODE).get(path).status_code == 403


def test_metrics_carry_the_claims_slice(cluster: None) -> None:
    text = token_client("prom", Role.VIEWER).get("/metrics").content.decode()
    line = next(
        line
        for line in text.splitlines()
        if line.startswith("tessera_slice_memory_limit") and CLAIM in line
    )
    assert 'namespace="team-a"' in line and 'container="gpu"' in line
    assert line.endswith(" 4096") or line.endswith(" 4096.0")
