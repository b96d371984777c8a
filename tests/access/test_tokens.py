"""`manage.py createtoken`, bearer tokens and roles."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from rest_framework.test import APIClient

from controlplane.access.models import ApiToken, digest
from controlplane.access.roles import Role, has_role, role_of

pytestmark = pytest.mark.django_db


def createtoken(*args: str) -> str:
    out = StringIO()
    call_command("createtoken", *args, stdout=out)
    return out.getvalue().strip()


def test_createtoken_prints_a_working_token_and_stores_only_its_digest() -> None:
    token = createtoken("gpu-node-1", "--role", "node")
    assert token.startswith("tsr_") and len(token) > 40
    stored = ApiToken.objects.get()
    assert stored.key_digest == digest(token) and token not in stored.key_digest
    user = get_user_model().objects.get(username="gpu-node-1")
    assert role_of(user) is Role.NODE and not user.has_usable_password()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    response = client.put(
        "/api/v1/nodes/gpu-node-1/inventory",
        {"plugin_version": "1", "cards": []},
        format="json",
    )
    assert response.status_code == 201, response.content


def test_a_second_token_and_a_role_change() -> None:
    first = createtoken("bob", "--role", "viewer")
    second = createtoken("bob", "--role", "operator")
    assert first != second and ApiToken.objects.count() == 2
    user = get_user_model().objects.get(username="bob")
    assert role_of(user) is Role.OPERATOR  # one role at a time


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("bob", "--role", "root"), "invalid choice"),
        (("Not_A_Node", "--role", "node"), "node name"),
        (("bad name!", "--role", "viewer"), "username"),
    ],
)
def test_createtoken_bad_input_is_refused_and_creates_nothing(args, message) -> None:
    with pytest.raises(CommandError, match=message):
        createtoken(*args)
    assert not ApiToken.objects.exists()
    assert not get_user_model().objects.exists()


def test_role_ranking() -> None:
    users = {}
    for role in Role:
        createtoken(f"u-{role.value}", "--role", role.value)
        users[role] = get_user_model().objects.get(username=f"u-{role.value}")
    assert has_role(users[Role.ADMIN], Role.OPERATOR)
    assert has_role(users[Role.OPERATOR], Role.VIEWER)
    assert not has_role(users[Role.VIEWER], Role.OPERATOR)
    assert not has_role(users[Role.NODE], Role.VIEWER)  # a machine identity is no person
    assert not has_role(users[Role.ADMIN], Role.NODE)
    assert users[Role.ADMIN].is_staff


def test_the_users_page_and_each_request_agree_on_a_role_held_through_several_groups() -> None:
    """One precedence (admin, operator, viewer, node) for an identity in several role groups:
    what a request is allowed (role_of) and what the access page lists (access_users)."""
    from django.contrib.auth.models import Group

    from controlplane.access.roles import ensure_groups
    from controlplane.dashboard.selectors import access_users

    groups = ensure_groups()
    users = get_user_model().objects
    cases = {
        "viewer-and-operator": [Role.VIEWER, Role.OPERATOR],
        "node-and-viewer": [Role.NODE, Role.VIEWER],
        "node-only": [Role.NODE],
        "no-group": [],
    }
    for name, roles in cases.items():
        user = users.create(username=name)
        user.groups.set([groups[r] for r in roles])
    users.create(username="root", is_superuser=True).groups.set([Group.objects.get(
        name=Role.VIEWER.group_name)])  # fmt: skip
    listed = {row.username: row.role for row in access_users()}
    for name in [*cases, "root"]:
        role = role_of(users.get(username=name))
        assert listed[name] == (role.value if role else None), name
    assert listed == {
        "viewer-and-operator": "operator",
        "node-and-viewer": "viewer",
        "node-only": "node",
        "no-group": None,
        "root": "admin",
    }


def test_expired_token_is_refused() -> None:
    from datetime import timedelta

    from django.utils import timezone

    token = createtoken("gpu-node-1", "--role", "node")
    ApiToken.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    response = client.put(
        "/api/v1/nodes/gpu-node-1/inventory", {"plugin_version": "1", "cards": []}, format="json"
    )
    assert response.status_code == 401


def test_a_token_in_x_tessera_token_works_where_authorization_is_absent() -> None:
    # The API server's service proxy keeps `Authorization` for itself (kubectl tessera).
    token = createtoken("alice", "--role", "viewer")
    client = APIClient()
    assert client.get("/api/v1/nodes/").status_code == 401
    client.credentials(HTTP_X_TESSERA_TOKEN=token)
    assert client.get("/api/v1/nodes/").status_code == 200
    client.credentials(HTTP_X_TESSERA_TOKEN=token[:-2] + "xx")
    assert client.get("/api/v1/nodes/").status_code == 401
    # The viewer's token does not become an operator's through the other header.
    client.credentials(HTTP_X_TESSERA_TOKEN=token)
    assert client.put("/api/v1/quotas/team-a/", {"gpus": 1}, format="json").status_code == 403
    # Where both are sent, `Authorization` decides: a bad one is not rescued by the other.
    client.credentials(HTTP_AUTHORIZATION="Bearer tsr_wrong", HTTP_X_TESSERA_TOKEN=token)
    assert client.get("/api/v1/nodes/").status_code == 401


def test_the_admin_sites_revoke_goes_through_the_audited_service() -> None:
    """The admin action revokes by the same service as the dashboard (one writer of `revoked`,
    audited); the change form shows `revoked` but cannot set it."""
    from django.test import Client

    from controlplane.ledger.models import AuditEvent

    token = createtoken("gpu-node-9", "--role", "node")
    createtoken("root", "--role", "admin")
    root = get_user_model().objects.get(username="root")
    root.is_staff = root.is_superuser = True
    root.save(update_fields=["is_staff", "is_superuser"])
    admin = Client()
    admin.force_login(root)
    stored = ApiToken.objects.get(user__username="gpu-node-9")
    page = admin.get(f"/admin/access/apitoken/{stored.pk}/change/")
    assert page.status_code == 200 and b'name="revoked"' not in page.content
    answer = admin.post(
        "/admin/access/apitoken/", {"action": "revoke", "_selected_action": [str(stored.pk)]}
    )
    assert answer.status_code == 302
    stored.refresh_from_db()
    assert stored.revoked
    (event,) = AuditEvent.objects.filter(action="token-revoke")
    assert (event.actor, event.target) == ("root", "gpu-node-9")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    refused = client.put(
        "/api/v1/nodes/gpu-node-9/inventory", {"plugin_version": "1", "cards": []}, format="json"
    )
    assert refused.status_code == 401
