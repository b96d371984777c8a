"""Node plugins authenticated by their projected ServiceAccount token (TokenReview)."""

from __future__ import annotations

import json

import pytest
from django.conf import settings
from django.test import override_settings
from rest_framework.test import APIClient

from controlplane.access import serviceaccount
from controlplane.access.roles import Role, role_of
from controlplane.access.services import grant_role
from controlplane.kube import adapter
from controlplane.kube import base as kube
from controlplane.ledger.models import Node

pytestmark = pytest.mark.django_db
SA = "system:serviceaccount:tessera-system:tessera-nodeplugin"
REPORT = {"plugin_version": "1", "cards": []}


class FakeReviews:
    """The adapter's TokenReview, answering from a table of known tokens."""

    def __init__(self, tokens: dict[str, dict]) -> None:
        self.tokens, self.calls = tokens, 0

    def review_token(self, token: str, audiences: list[str]) -> dict:
        self.calls += 1
        assert audiences == ["tessera"]
        if token == "apiserver-down":
            raise kube.KubeError("API server unreachable", None, False)
        return self.tokens.get(token, {"authenticated": False, "error": "invalid bearer token"})


def bound(username: str, node: str | None) -> dict:
    extra = {serviceaccount.NODE_NAME_EXTRA: [node]} if node else {}
    return {"authenticated": True, "user": {"username": username, "extra": extra}}


@pytest.fixture
def reviews(monkeypatch):
    fake = FakeReviews(
        {
            "sa-gpu-1": bound(SA, "gpu-1"),
            "sa-unbound": bound(SA, None),
            "other-sa": bound("system:serviceaccount:default:builder", "gpu-1"),
        }
    )
    monkeypatch.setattr(adapter, "get_kube", lambda: fake)
    serviceaccount.clear_cache()
    with override_settings(
        TESSERA={
            **settings.TESSERA,
            "KUBE_MODE": "incluster",
            "NODE_SERVICE_ACCOUNTS": "tessera-system:tessera-nodeplugin",
        }
    ):
        yield fake
    serviceaccount.clear_cache()


def put(token: str, node: str):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client.put(
        f"/api/v1/nodes/{node}/inventory", json.dumps(REPORT), content_type="application/json"
    )


def test_a_node_plugins_token_reports_its_own_node_and_is_cached(reviews) -> None:
    assert put("sa-gpu-1", "gpu-1").status_code == 201
    assert put("sa-gpu-1", "gpu-1").status_code == 200
    assert reviews.calls == 1  # the second request used the cached review
    from django.contrib.auth import get_user_model

    assert role_of(get_user_model().objects.get(username="gpu-1")) is Role.NODE


@pytest.mark.parametrize(
    ("token", "node", "status", "words"),
    [
        ("sa-gpu-1", "gpu-2", 403, "gpu-1"),  # another node's inventory
        ("sa-unbound", "gpu-1", 401, "not bound to a node"),
        ("other-sa", "gpu-1", 401, "not a Tessera node plugin"),
        ("forged", "gpu-1", 401, "invalid bearer token"),
        ("apiserver-down", "gpu-1", 401, "Cannot check the token"),
    ],
)
def test_refusals_say_why_and_change_nothing(reviews, token, node, status, words) -> None:
    response = put(token, node)
    assert response.status_code == status, response.content
    assert words in response.json()["error"]
    assert not Node.objects.exists()


def test_a_persons_account_is_never_turned_into_a_node(reviews) -> None:
    grant_role("gpu-1", Role.ADMIN)
    response = put("sa-gpu-1", "gpu-1")
    assert response.status_code == 401 and "not a node identity" in response.json()["error"]
    from django.contrib.auth import get_user_model

    assert role_of(get_user_model().objects.get(username="gpu-1")) is Role.ADMIN


def test_without_a_cluster_foreign_tokens_are_plainly_invalid() -> None:
    response = put("sa-gpu-1", "gpu-1")
    assert response.status_code == 401
    assert not Node.objects.exists()
