"""The admin's access page: users with their role (the one precedence,
`controlplane.access.roles.role_from_groups`) and API tokens."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import Count, Q

from controlplane.access.models import ApiToken
from controlplane.access.roles import role_from_groups


@dataclass(frozen=True, slots=True)
class UserRow:
    """A user with their Tessera role and token counts, for the admin's access page."""

    username: str
    role: str | None
    is_active: bool
    last_login: datetime | None
    tokens_active: int


def access_users() -> list[UserRow]:
    """Every user with role and live token count (two queries)."""
    users = list(
        get_user_model()
        .objects.order_by("username")
        .annotate(tokens_active=Count("api_tokens", filter=Q(api_tokens__revoked=False)))
        .values_list("id", "username", "is_superuser", "is_active", "last_login", "tokens_active")
    )
    groups: dict[int, set[str]] = defaultdict(set)
    through = get_user_model().groups.through
    for user_id, name in through.objects.values_list("user_id", "group__name"):
        groups[user_id].add(name)
    rows = []
    for user_id, username, superuser, active, last_login, tokens in users:
        role = role_from_groups(groups[user_id], superuser)  # no query per user
        rows.append(UserRow(username, role.value if role else None, active, last_login, tokens))
    return rows


def access_tokens(limit: int = 200) -> list[dict[str, Any]]:
    """The newest API tokens (digest never included), one query."""
    return list(
        ApiToken.objects.order_by("revoked", "-created_at").values(
            "id",
            "prefix",
            "label",
            "user__username",
            "created_at",
            "last_used_at",
            "expires_at",
            "revoked",
        )[:limit]
    )
