"""Services that write access rows: identities and tokens."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractUser
from django.db import transaction

from controlplane.access.models import ApiToken, digest, new_token
from controlplane.access.roles import Role, ensure_groups


@transaction.atomic
def grant_role(username: str, role: Role) -> AbstractUser:
    """Create the user if needed and make `role` its one Tessera role."""
    user_model = get_user_model()
    user, created = user_model.objects.get_or_create(username=username)
    if created:
        user.set_unusable_password()  # token-only until someone sets a password
        user.save(update_fields=["password"])
    groups = ensure_groups()
    user.groups.remove(*[g for r, g in groups.items() if r is not role])
    user.groups.add(groups[role])
    if role is Role.ADMIN and not user.is_staff:
        user.is_staff = True
        user.save(update_fields=["is_staff"])
    return user  # type: ignore[no-any-return]


@transaction.atomic
def create_token(username: str, role: Role, label: str = "") -> str:
    """Grant `role` to `username` (creating it) and return a new token, shown only now."""
    user = grant_role(username, role)
    token = new_token()
    ApiToken.objects.create(
        user=user, label=label[:100], prefix=token[:10], key_digest=digest(token)
    )
    return token
