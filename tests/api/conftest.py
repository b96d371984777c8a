"""The schema sweep's summary (tests/api/test_schemathesis.py) at the end of pytest's report."""

from __future__ import annotations

from typing import Any

import pytest

_SWEEP_SUMMARY = pytest.StashKey[list[str]]()


@pytest.fixture
def sweep_summary(request: pytest.FixtureRequest) -> list[str]:
    """Lines for the "Schemathesis summary per role" section, one per role's run."""
    return request.config.stash.setdefault(_SWEEP_SUMMARY, [])


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    lines = config.stash.get(_SWEEP_SUMMARY, [])
    if lines:
        terminalreporter.section("Schemathesis summary per role")
        for line in lines:
            terminalreporter.write_line(line)
