"""Fixtures shared by the Django-side tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from controlplane.access.roles import Role
from tests.builders import token_client
from tests.ledger_guard import guarded
from tests.workers import RedisServer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `database` every test that uses the test database (pytest-django's marker, or a
    fixture that sets the database up, directly or through another fixture): the PostgreSQL
    stage of `make test` runs those alone, the rest need not run once per database."""
    for item in items:
        uses = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("django_db") is not None or "django_db_setup" in uses:
            item.add_marker(pytest.mark.database)


@pytest.fixture
def admin_client(db: None) -> APIClient:
    return token_client("alice-admin", Role.ADMIN)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own (the worker tests restart it mid-run), killed at the end."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _only_ledger_services_write_ledger_rows(request: pytest.FixtureRequest) -> Iterator[None]:
    """For every database test: no ledger row is written but by the ledger's services."""
    node = request.node
    if node.get_closest_marker("django_db") is None or node.get_closest_marker("ledger_guard_off"):
        yield
        return
    # The test database is set up first: `db` is pytest-django's public way to ask for it (a
    # test marked transactional, or asking for `transactional_db`, still gets that).
    request.getfixturevalue("db")
    with guarded() as guard:
        yield
    assert not guard.violations, "ledger rows written outside controlplane/ledger/services/:\n" + (
        "\n".join(sorted(set(guard.violations)))
    )
