"""Headless Chromium (Debian's `chromium`) driven by Playwright for Python, against a live server.

Chromium comes from Debian's package, installed by scripts/browser.sh when absent; Playwright's
own browser download (`playwright install`) is never used. The tests run with a real server
thread (pytest-django `live_server`) and transactional database access.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CHROMIUM = Path(os.environ.get("TESSERA_CHROMIUM", "/usr/bin/chromium"))
SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def chromium_path() -> Path:
    """Debian's chromium, installed by scripts/browser.sh on first use."""
    if not CHROMIUM.exists():
        subprocess.run([str(ROOT / "scripts" / "browser.sh")], check=True)
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing; run scripts/browser.sh"
    return CHROMIUM


@pytest.fixture(scope="module")
def browser(chromium_path: Path) -> Iterator[object]:
    """Module-scoped: Playwright's loop must be gone before later tests (e.g. the node plugin's
    asyncio ones) run in this thread."""
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread; Django refuses ORM calls from a
    # thread with a running loop unless told that this (test-only) use is deliberate.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            instance = playwright.chromium.launch(
                executable_path=str(chromium_path), args=CHROMIUM_ARGS, headless=True
            )
            yield instance
            instance.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(browser: object) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1440, "height": 900})  # type: ignore[attr-defined]
    context.set_default_timeout(15_000)
    tab = context.new_page()
    yield tab
    context.close()


@pytest.fixture
def screenshot_dir() -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
