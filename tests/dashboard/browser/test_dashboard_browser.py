"""The dashboard in a real browser: sign-in, slices on cards, filters, quotas, live updates."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from controlplane.access.roles import Role
from controlplane.dashboard import views
from controlplane.dashboard.models import AllocationSample
from controlplane.ledger.models import NamespaceQuota
from controlplane.ledger.services.cordons import set_card_cordon
from controlplane.ledger.services.nodes import InventoryReport, apply_inventory
from controlplane.ledger.services.quotas import QuotaLimitsInput, set_quota
from tests.builders import card_report
from tests.dashboard.builders import PASSWORD, decision, make_node, person, pod
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db(transaction=True)


def sign_in(page: Any, base: str, username: str, next_path: str = "/") -> None:
    page.goto(f"{base}{next_path}")
    assert "/login/" in page.url  # the page sent us to sign in first
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}{next_path}")


def cluster() -> None:
    """A small cluster that looks like a real one: several models, namespaces and states."""
    make_node("gpu-a100-0", cards=4, memory_mib=81920)
    make_node("gpu-a100-1", cards=4, memory_mib=81920)
    make_node("gpu-l4-0", cards=2, memory_mib=23034, model="NVIDIA L4")
    apply_inventory(
        "gpu-h100-0",
        InventoryReport(
            "0.1.0",
            tuple(
                card_report(
                    f"GPU-gpu-h100-0-{i}",
                    i,
                    81559,
                    model="NVIDIA H100 80GB HBM3",
                    healthy=i != 3,
                    health_reason="" if i != 3 else "XID 79: GPU has fallen off the bus",
                )
                for i in range(4)
            ),
        ),
        "gpu-h100-0",
    )
    pod("train-llm-0", "gpu-a100-0", gpu_container("trainer", 2, 40960, 50), namespace="ml-train")
    pod("train-llm-1", "gpu-a100-1", gpu_container("trainer", 2, 40960, 50), namespace="ml-train")
    for i in range(5):
        node = "gpu-a100-0" if i < 3 else "gpu-h100-0"
        pod(f"infer-{i}", node, gpu_container("server", mem=10240, cores=20), namespace="serving")
    notebook = gpu_container("jupyter", mem=8192, cores=30)
    pod("notebook-ana", "gpu-l4-0", notebook, namespace="research")
    pod("notebook-bo", "gpu-l4-0", notebook, namespace="research")
    etl = gpu_container("job", mem=20480, cores=40)
    pod("etl-7", "gpu-h100-0", etl, namespace="batch", phase="reserved")
    decision(
        "giant-0",
        namespace="ml-train",
        summary="No node has a card with 90000 MiB free.",
        reason_counts={"insufficient_memory": 4},
        nodes_considered=4,
    )
    set_quota("ml-train", QuotaLimitsInput(gpumem_mib=327680, gpucores=400, gpus=8), "alice")
    set_quota("research", QuotaLimitsInput(gpumem_mib=20480, gpus=2), "alice")
    set_card_cordon("GPU-gpu-a100-1-3", True, "alice", "ECC errors under investigation")
    now = timezone.now()
    total = 8 * 81920 + 2 * 23034 + 4 * 81559
    AllocationSample.objects.bulk_create(
        AllocationSample(
            bucket=(now - timedelta(minutes=5 * k)).replace(second=0, microsecond=0),
            cards=14,
            memory_total_mib=total,
            memory_allocated_mib=int(total * (0.22 + 0.12 * ((k * 7) % 11) / 11)),
            compute_total=1400,
            compute_allocated=int(1400 * (0.15 + 0.1 * ((k * 5) % 9) / 9)),
            slices=12,
            pending_pods=k % 3,
        )
        for k in range(1, 72)
    )


def test_sign_in_and_see_the_overview(page: Any, live_server: Any, screenshot_dir: Path) -> None:
    cluster()
    person("vera", Role.VIEWER)
    sign_in(page, live_server.url, "vera")
    assert page.locator('[data-stat="cards"]').inner_text().strip() == "14"
    assert page.locator('[data-stat="unhealthy"]').inner_text().strip() == "1"
    assert page.locator('[data-stat="pending"]').inner_text().strip() == "2"
    assert page.locator("svg.chart polyline").count() == 2
    assert page.locator(".role").inner_text() == "viewer"
    page.screenshot(path=str(screenshot_dir / "overview.png"), full_page=True)

    page.goto(f"{live_server.url}/pods/ml-train/giant-0/")
    assert "Pending: No node has a card with 90000 MiB free." in page.inner_text(".why-text")
    page.screenshot(path=str(screenshot_dir / "pod-pending.png"), full_page=True)
    page.goto(f"{live_server.url}/audit/")
    page.screenshot(path=str(screenshot_dir / "audit.png"), full_page=True)

    page.click("text=Sign out")
    page.wait_for_url(re.compile(r".*/login/$"))
    page.goto(f"{live_server.url}/nodes/")
    assert "/login/" in page.url


def test_nodes_show_cards_split_into_slices(
    page: Any, live_server: Any, screenshot_dir: Path
) -> None:
    cluster()
    person("vera", Role.VIEWER)
    sign_in(page, live_server.url, "vera", "/nodes/")
    node = page.locator('[data-node="gpu-a100-0"]')
    assert node.locator(".cardrow").count() == 4
    segments = node.locator('.bar:not(.thin) .seg[data-pod="ml-train/train-llm-0"]')
    assert segments.count() == 2  # two slices, on two cards
    title = segments.first.get_attribute("title")
    assert title == "ml-train/train-llm-0 · container trainer · 40960 MiB · 50%"
    width = segments.first.bounding_box()["width"]
    bar = node.locator(".bar:not(.thin)").first.bounding_box()["width"]
    assert width == pytest.approx(bar * 0.5, abs=3)  # 40960 of 81920 MiB
    sick = page.locator('[data-card="GPU-gpu-h100-0-3"] .badge')
    assert sick.inner_text() == "unhealthy"
    page.screenshot(path=str(screenshot_dir / "nodes.png"), full_page=True)

    page.click('[data-card="GPU-gpu-a100-0-0"] a.cardname')
    page.wait_for_url(re.compile(r".*/cards/GPU-gpu-a100-0-0/$"))
    assert page.locator("table.table tbody tr").count() >= 1
    page.screenshot(path=str(screenshot_dir / "card.png"), full_page=True)


def test_filter_bindings_by_namespace(page: Any, live_server: Any, screenshot_dir: Path) -> None:
    cluster()
    person("vera", Role.VIEWER)
    sign_in(page, live_server.url, "vera", "/bindings/")
    rows = page.locator("#bindings tbody tr[data-binding]")
    assert rows.count() == 10
    page.select_option('select[name="namespace"]', "research")
    page.click("form.filters button[type=submit]")
    page.wait_for_url(re.compile(r".*namespace=research.*"))
    names = sorted(rows.evaluate_all("rows => rows.map(r => r.dataset.binding)"))
    assert names == ["research/notebook-ana", "research/notebook-bo"]
    page.click("#bindings thead a:has-text('Pod')")
    page.wait_for_url(re.compile(r".*sort=pod.*"))
    assert rows.first.get_attribute("data-binding") == "research/notebook-ana"
    assert "namespace=research" in page.url  # sorting keeps the filter
    page.goto(f"{live_server.url}/bindings/")
    page.screenshot(path=str(screenshot_dir / "bindings.png"), full_page=True)


def test_operator_edits_a_quota_and_sees_it(
    page: Any, live_server: Any, screenshot_dir: Path
) -> None:
    cluster()
    person("otto", Role.OPERATOR)
    sign_in(page, live_server.url, "otto", "/quotas/")
    page.click('tr[data-namespace="research"] button:has-text("Edit")')
    assert page.input_value("#id_namespace") == "research"
    page.fill("#id_gpumem_mib", "40960")
    page.fill("#id_gpus", "4")
    page.click("#quota-form button[type=submit]")
    page.wait_for_selector("text=Quota of research updated.")
    row = page.locator('tr[data-namespace="research"]')
    assert "16 GiB / 40 GiB" in row.inner_text()
    assert "2 / 4" in row.inner_text()
    quota = NamespaceQuota.objects.get(namespace="research")
    assert (quota.gpumem_mib, quota.gpus, quota.updated_by) == (40960, 4, "otto")

    page.fill("#id_namespace", "Not_Valid")
    page.click("#quota-form button[type=submit]")
    assert "not a valid namespace name" in page.inner_text('[data-error-for="namespace"]')
    page.goto(f"{live_server.url}/quotas/")
    page.screenshot(path=str(screenshot_dir / "quotas-operator.png"), full_page=True)


def test_viewer_cannot_edit_quotas(page: Any, live_server: Any, screenshot_dir: Path) -> None:
    cluster()
    person("vera", Role.VIEWER)
    sign_in(page, live_server.url, "vera", "/quotas/")
    assert page.locator("#quota-form").count() == 0
    assert page.locator('button:has-text("Edit")').count() == 0
    # Even a hand-made POST with a valid CSRF token is refused.
    status = page.evaluate(
        """async () => {
            // The page's own token (the sign-out form's): it lives in the session, no cookie.
            const token = document.querySelector('input[name=csrfmiddlewaretoken]').value;
            const body = new URLSearchParams(
                {namespace: 'research', gpus: '99', csrfmiddlewaretoken: token});
            const r = await fetch('/quotas/', {method: 'POST', body});
            return r.status;
        }"""
    )
    assert status == 403
    assert NamespaceQuota.objects.get(namespace="research").gpus == 2
    page.screenshot(path=str(screenshot_dir / "quotas-viewer.png"), full_page=True)


def test_live_update_appears_without_reload(page: Any, live_server: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(views, "POLL_SECONDS", 1)  # the server thread shares this module
    cluster()
    person("vera", Role.VIEWER)
    sign_in(page, live_server.url, "vera")
    slices = page.locator('[data-stat="slices"]')
    before = int(slices.inner_text())
    page.evaluate("window.__stillTheSamePage = 'yes'")
    pod("late-arrival", "gpu-l4-0", gpu_container(mem=1024, cores=5), namespace="batch")
    page.wait_for_function(
        f"""() => document.querySelector('[data-stat="slices"]').textContent.trim()
            === '{before + 1}'""",
        timeout=15_000,
    )
    assert page.evaluate("window.__stillTheSamePage") == "yes"  # no navigation happened
    # the nodes page updates in place too
    page.goto(f"{live_server.url}/nodes/?q=gpu-l4-0")
    page.evaluate("window.__stillTheSamePage = 'yes'")
    pod("later-still", "gpu-l4-0", gpu_container(mem=1024, cores=5), namespace="batch")
    page.wait_for_selector('.seg[data-pod="batch/later-still"]', timeout=15_000)
    assert page.evaluate("window.__stillTheSamePage") == "yes"


def test_admin_issues_a_token(page: Any, live_server: Any, screenshot_dir: Path) -> None:
    cluster()
    person("root", Role.ADMIN)
    sign_in(page, live_server.url, "root", "/access/")
    page.fill("#id_username", "prometheus")
    page.select_option("#id_role", "viewer")
    page.fill("#id_token_label", "scrape")
    page.check("#id_issue_token")
    page.click("#grant-form button[type=submit]")
    token = page.inner_text("#new-token")
    assert token.startswith("tsr_")
    assert "viewer" in page.inner_text('tr[data-user="prometheus"]')
    page.screenshot(path=str(screenshot_dir / "access.png"), full_page=True)
