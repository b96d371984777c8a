"""The Content-Security-Policy in a real browser: every page, the admin's and the sign-in's
included, loads and works under the enforced policy, and the browser reports no violation."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings

from controlplane.access.roles import Role
from controlplane.dashboard import views
from controlplane.ledger.models import Card
from tests.dashboard.browser.test_dashboard_browser import cluster, sign_in
from tests.dashboard.builders import person

pytestmark = pytest.mark.django_db(transaction=True)

# Installed before any script of the page runs: every violation the page reports.
WATCH = """
window.__cspViolations = [];
document.addEventListener('securitypolicyviolation', (e) => window.__cspViolations.push(
  `${e.effectiveDirective} blocked ${e.blockedURI || 'inline'} at ${e.sourceFile}:` +
  `${e.lineNumber}`));
"""


@pytest.fixture
def watched(browser: Any) -> Any:
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    context.set_default_timeout(15_000)
    context.add_init_script(WATCH)
    tab = context.new_page()
    tab.console_csp = []  # the browser's own console lines about the policy
    tab.on(
        "console",
        lambda m: "Content Security Policy" in m.text and tab.console_csp.append(m.text),
    )
    yield tab
    context.close()


def violations(page: Any) -> list[str]:
    return [*page.evaluate("window.__cspViolations"), *page.console_csp]


def visit(page: Any, url: str) -> None:
    response = page.goto(url)
    assert response is not None and response.ok, f"{url}: {response and response.status}"
    policy = response.headers.get("content-security-policy", "")
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy, (url, policy)
    page.wait_for_load_state("load")
    assert violations(page) == [], f"{url}: {violations(page)}"


def test_no_page_reports_a_violation(watched: Any, live_server: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(views, "POLL_SECONDS", 1)  # let a live fragment swap in, too
    cluster()
    root = person("root", Role.ADMIN)
    root.is_staff = root.is_superuser = True
    root.save(update_fields=["is_staff", "is_superuser"])
    page, base = watched, live_server.url

    visit(page, f"{base}/login/")
    sign_in(page, base, "root", "/")
    assert violations(page) == []
    card = Card.objects.get(uuid="GPU-gpu-a100-0-0")
    for path in (
        "/",
        "/nodes/",
        "/grid/",
        "/nodes/gpu-a100-0/",
        "/cards/GPU-gpu-a100-0-0/",
        "/bindings/",
        "/pods/ml-train/train-llm-0/",
        "/pods/ml-train/giant-0/",
        "/quotas/",
        "/audit/",
        "/api/docs/",
        "/access/",
        "/admin/",
        "/admin/ledger/card/",
        f"/admin/ledger/card/{card.pk}/change/",
        "/admin/axes/accessattempt/",
    ):
        visit(page, f"{base}{path}")

    # The widths set by the dashboard's script, not by style attributes, and after a live swap.
    visit(page, f"{base}/")
    page.wait_for_timeout(2500)  # past a poll: the live fragment was replaced
    assert violations(page) == []
    meter = page.locator('[data-stat="memory"] ~ .meter > span').bounding_box()
    assert meter is not None and meter["width"] > 0
    # The quota form is filled by the script, not an inline handler.
    visit(page, f"{base}/quotas/")
    page.click('tr[data-namespace="research"] button:has-text("Edit")')
    assert page.input_value("#id_namespace") == "research"
    assert violations(page) == []


def test_sign_in_pages_and_the_lockout_report_no_violation(watched: Any, live_server: Any) -> None:
    person("olga", Role.OPERATOR)
    page, base = watched, live_server.url
    for path in ("/login/", "/admin/login/"):
        visit(page, f"{base}{path}")
    for _ in range(settings.AXES_FAILURE_LIMIT):
        visit(page, f"{base}/login/")
        page.fill("#id_username", "olga")
        page.fill("#id_password", "wrong-password")
        page.click("button[type=submit]")
        page.wait_for_load_state("load")
    assert page.locator("[data-locked-out]").count() == 1
    assert "Too many failed sign-ins" in page.inner_text("main")
    assert violations(page) == []
