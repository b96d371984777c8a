"""Sign-in throttling (django-axes): password guessing at /login/ and /admin/login/ is locked out
per username and client address, for a cool-off, without touching API tokens."""

from __future__ import annotations

from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.core.management import call_command
from django.test import Client
from rest_framework.test import APIClient

from controlplane.access.roles import Role
from controlplane.access.services import create_token
from tests.dashboard.builders import PASSWORD, person

pytestmark = pytest.mark.django_db

HOME = "10.0.0.7"


def sign_in(
    client: Client, username: str, password: str, *, path: str = "/login/", ip: str = HOME,
    **extra: str,
):  # fmt: skip
    return client.post(path, {"username": username, "password": password}, REMOTE_ADDR=ip, **extra)


def guess(username: str, times: int, *, path: str = "/login/", ip: str = HOME, **extra: str):
    client = Client()
    for _ in range(times):
        response = sign_in(client, username, "wrong-password", path=path, ip=ip, **extra)
    return response


def signs_in(username: str, *, path: str = "/login/", ip: str = HOME, **extra: str) -> bool:
    response = sign_in(Client(), username, PASSWORD, path=path, ip=ip, **extra)
    return response.status_code == 302


def test_guessing_locks_the_username_from_that_address_out() -> None:
    person("olga", Role.OPERATOR)
    limit = settings.AXES_FAILURE_LIMIT
    assert guess("olga", limit - 1).status_code == 200  # wrong, but not locked yet
    locked = guess("olga", 1)
    assert locked.status_code == 429
    assert signs_in("olga") is False  # the right password is refused too
    refused = sign_in(Client(), "olga", PASSWORD)
    assert refused.status_code == 429
    body = refused.content.decode()
    assert "Too many failed sign-ins" in body and "olga" in body
    assert "axes_reset_username olga" in body
    assert int(refused["Retry-After"]) == int(settings.AXES_COOLOFF_TIME.total_seconds())
    assert "_auth_user_id" not in Client().session  # and nobody was signed in


def test_other_people_and_other_addresses_are_not_affected() -> None:
    person("olga", Role.OPERATOR)
    person("vera", Role.VIEWER)
    guess("olga", settings.AXES_FAILURE_LIMIT)
    assert signs_in("olga") is False
    assert signs_in("vera")  # someone else from the same address
    assert signs_in("olga", ip="10.0.0.8")  # the same person from elsewhere


def test_after_the_cool_off_the_right_password_works() -> None:
    person("olga", Role.OPERATOR)
    guess("olga", settings.AXES_FAILURE_LIMIT)
    assert signs_in("olga") is False
    past = settings.AXES_COOLOFF_TIME + timedelta(seconds=1)
    for attempt in AccessAttempt.objects.all():
        AccessAttempt.objects.filter(pk=attempt.pk).update(attempt_time=attempt.attempt_time - past)
    assert signs_in("olga")


def test_a_success_clears_the_count() -> None:
    person("olga", Role.OPERATOR)
    limit = settings.AXES_FAILURE_LIMIT
    guess("olga", limit - 1)
    assert signs_in("olga")
    assert guess("olga", limit - 1).status_code == 200
    assert signs_in("olga")


def test_the_admin_sign_in_is_throttled_too() -> None:
    root = person("root", Role.ADMIN)
    root.is_staff = True
    root.save(update_fields=["is_staff"])
    path = "/admin/login/?next=/admin/"
    assert guess("root", settings.AXES_FAILURE_LIMIT, path=path).status_code == 429
    assert signs_in("root", path=path) is False
    assert signs_in("root", path=path, ip="10.0.0.8")


def test_api_tokens_are_not_throttled() -> None:
    person("olga", Role.OPERATOR)
    token = create_token("olga", Role.OPERATOR)
    guess("olga", settings.AXES_FAILURE_LIMIT + 3)
    assert signs_in("olga") is False
    api = APIClient(REMOTE_ADDR=HOME)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert api.get("/api/v1/nodes/").status_code == 200


@pytest.mark.parametrize(
    "unlock",
    [
        lambda: call_command("axes_reset_username", "olga", verbosity=0),
        lambda: call_command("axes_reset_ip_username", HOME, "olga", verbosity=0),
    ],
    ids=["username", "address-and-username"],
)
def test_an_admin_unlocks_with_a_command(unlock) -> None:
    person("olga", Role.OPERATOR)
    guess("olga", settings.AXES_FAILURE_LIMIT)
    assert signs_in("olga") is False
    unlock()
    assert signs_in("olga")


def test_an_admin_sees_and_deletes_the_lockout_in_the_admin() -> None:
    person("olga", Role.OPERATOR)
    guess("olga", settings.AXES_FAILURE_LIMIT)
    root = person("root", Role.ADMIN)
    root.is_staff = root.is_superuser = True
    root.save(update_fields=["is_staff", "is_superuser"])
    admin = Client()
    admin.force_login(root)
    listing = admin.get("/admin/axes/accessattempt/")
    assert listing.status_code == 200 and b"olga" in listing.content
    attempt = AccessAttempt.objects.get(username="olga")
    deleted = admin.post(f"/admin/axes/accessattempt/{attempt.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 302
    assert signs_in("olga")


class TestBehindTheTLSProxy:
    """The client's address is the entry the ingress appended to X-Forwarded-For."""

    @pytest.fixture(autouse=True)
    def _proxy(self, settings) -> None:
        settings.TESSERA = {**settings.TESSERA, "BEHIND_TLS_PROXY": True, "PROXY_HOPS": 1}

    INGRESS = "10.244.0.5"  # every request arrives from the ingress controller's pod

    def test_clients_behind_one_ingress_are_told_apart(self) -> None:
        person("olga", Role.OPERATOR)
        attacker = {"ip": self.INGRESS, "HTTP_X_FORWARDED_FOR": "203.0.113.9"}
        guess("olga", settings.AXES_FAILURE_LIMIT, **attacker)
        assert signs_in("olga", **attacker) is False
        assert signs_in("olga", ip=self.INGRESS, HTTP_X_FORWARDED_FOR="198.51.100.4")

    def test_a_forged_entry_does_not_escape_the_lockout(self) -> None:
        person("olga", Role.OPERATOR)
        guess("olga", settings.AXES_FAILURE_LIMIT, ip=self.INGRESS,
              HTTP_X_FORWARDED_FOR="203.0.113.9")  # fmt: skip
        # The attacker sends its own X-Forwarded-For; the ingress appends the real address.
        forged = {"ip": self.INGRESS, "HTTP_X_FORWARDED_FOR": "192.0.2.1, 203.0.113.9"}
        assert signs_in("olga", **forged) is False

    def test_without_the_proxy_setting_the_header_is_ignored(self, settings) -> None:
        settings.TESSERA = {**settings.TESSERA, "BEHIND_TLS_PROXY": False}
        person("olga", Role.OPERATOR)
        guess("olga", settings.AXES_FAILURE_LIMIT, HTTP_X_FORWARDED_FOR="203.0.113.9")
        assert signs_in("olga", HTTP_X_FORWARDED_FOR="198.51.100.4") is False
