"""Services that write access rows: identities and tokens."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractUser
from django.contrib.auth.validators import UnicodeUsernameValidator
from django.core.exceptions import ValidationError
from django.db import transaction

from controlplane.access.models import ApiToken, digest, new_token
from controlplane.access.roles import Role, ensure_groups
from controlplane.ledger.errors import NotFound, ServiceError
from controlplane.ledger.services.audit import record_event
from controlplane.ledger.validation import NODE_NAME_HELP, is_node_name

MAX_USERNAME = 150


def check_username(username: object, role: Role) -> None:
    """ServiceError unless `username` may hold `role`: Django's username rule (whole string),
    and for a node identity the Kubernetes node name it reports inventory as."""
    try:
        if not isinstance(username, str) or len(username) > MAX_USERNAME:
            raise ValidationError("too long")
        UnicodeUsernameValidator()(username)
    except ValidationError:
        raise ServiceError(
            f"username: {username!r}: give 1 to {MAX_USERNAME} letters, digits and @.+-_",
            field="username",
        ) from None
    if role is Role.NODE and not is_node_name(username):
        raise ServiceError(
            f"username: {username!r} for the node role: {NODE_NAME_HELP}", field="username"
        )


@transaction.atomic
def grant_role(username: str, role: Role) -> AbstractUser:
    """Create the user if needed and make `role` its one Tessera role (ServiceError for a
    username the role may not have, see check_username)."""
    check_username(username, role)
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


@transaction.atomic
def revoke_token(token_id: int, actor: str) -> None:
    """Revoke an API token (it authenticates nobody from now on). Audited; idempotent. The one
    writer of `revoked`: the dashboard and the admin site both come here."""
    token = ApiToken.objects.select_for_update().select_related("user").filter(pk=token_id).first()
    if token is None:
        raise NotFound(f"no API token {token_id}", field="token")
    if not token.revoked:
        token.revoked = True
        token.save(update_fields=["revoked"])
        record_event(actor, "token-revoke", "user", token.user.get_username(), prefix=token.prefix)
