"""Fixtures shared by the Django-side tests."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from controlplane.access.roles import Role
from tests.builders import token_client


@pytest.fixture
def admin_client(db: None) -> APIClient:
    return token_client("alice-admin", Role.ADMIN)
