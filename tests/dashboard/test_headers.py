"""Security headers of the pages under the development/test settings, and templates the policy
can hold to. (Production's: tests/test_security_headers.py; in a browser:
tests/dashboard/browser/test_csp_browser.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client

from controlplane.access.roles import Role
from tests.dashboard.builders import person, signed_in
from tests.dashboard.test_pages import PAGES, cluster  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = sorted((ROOT / "templates").rglob("*.html"))


def directives(response) -> dict[str, str]:
    policy = response["Content-Security-Policy"]
    return {
        part.split()[0]: " ".join(part.split()[1:]) for part in policy.split(";") if part.strip()
    }


@pytest.mark.parametrize("url", PAGES)
def test_every_page_has_the_policy(cluster: None, url: str) -> None:  # noqa: F811
    response = signed_in(Role.OPERATOR).get(url)
    assert response.status_code == 200
    policy = directives(response)
    assert policy["default-src"] == "'self'"
    assert policy["script-src"] == "'self'" and policy["style-src"] == "'self'"
    assert policy["object-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
    assert "unsafe" not in response["Content-Security-Policy"]


@pytest.mark.parametrize("url", ["/login/", "/admin/login/"])
def test_sign_in_pages_have_the_policy(url: str) -> None:
    response = Client().get(url)
    assert response.status_code == 200
    assert directives(response)["script-src"] == "'self'"


def test_the_locked_out_page_has_the_policy() -> None:
    person("olga", Role.OPERATOR)
    client = Client()
    for _ in range(settings.AXES_FAILURE_LIMIT):
        response = client.post("/login/", {"username": "olga", "password": "wrong"})
    assert response.status_code == 429
    assert directives(response)["script-src"] == "'self'"


INLINE = [
    (re.compile(r"\sstyle\s*=", re.IGNORECASE), "a style attribute"),
    (re.compile(r"<style\b", re.IGNORECASE), "a <style> element"),
    (re.compile(r"<script\b(?![^>]*\bsrc=)", re.IGNORECASE), "an inline <script>"),
    (re.compile(r"\son[a-z]+\s*=", re.IGNORECASE), "an inline event handler"),
    (re.compile(r"javascript:", re.IGNORECASE), "a javascript: URL"),
]


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: str(p.relative_to(ROOT)))
def test_templates_have_nothing_inline_the_policy_would_block(template: Path) -> None:
    text = template.read_text()
    found = [what for pattern, what in INLINE if pattern.search(text)]
    assert not found, f"{template.name} has {', '.join(found)}: use static/dashboard/tessera.js"


def test_the_card_bars_carry_their_widths_as_data(cluster: None) -> None:  # noqa: F811
    body = signed_in(Role.VIEWER).get("/nodes/").content.decode()
    assert "data-width=" in body and "style=" not in body
