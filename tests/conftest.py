"""Fixtures shared by the Django-side tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from controlplane.access.roles import Role
from tests.builders import token_client
from tests.workers import RedisServer


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
