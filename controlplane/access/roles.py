"""Roles of Tessera identities.

People are viewer < operator < admin (each includes the ones below). `node` is a machine
identity for node plugins: it may report its own node's inventory and nothing a person does.
Roles are Django groups named `tessera-<role>`, so the admin site can manage them; a superuser
is an admin.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import StrEnum

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, Group


class Role(StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    ADMIN = "admin"
    NODE = "node"

    @property
    def group_name(self) -> str:
        return f"tessera-{self.value}"


HUMAN_RANK = {Role.VIEWER: 1, Role.OPERATOR: 2, Role.ADMIN: 3}
# An identity in several role groups holds the first of these it is in.
PRECEDENCE = (Role.ADMIN, Role.OPERATOR, Role.VIEWER, Role.NODE)


def role_from_groups(group_names: Collection[str], superuser: bool = False) -> Role | None:
    """The role an identity with these group names holds (a superuser is an admin): the one
    rule, for `role_of` and for pages that read many users' groups at once."""
    if superuser:
        return Role.ADMIN
    for candidate in PRECEDENCE:
        if candidate.group_name in group_names:
            return candidate
    return None


def role_of(user: AbstractBaseUser | AnonymousUser | None) -> Role | None:
    """The identity's role, or None for anonymous/inactive users or users with no role.

    Uses the prefetched/cached groups when present (one query otherwise).
    """
    if user is None or not user.is_authenticated or not user.is_active:
        return None
    if getattr(user, "is_superuser", False):
        return Role.ADMIN
    cached = getattr(user, "_tessera_role", False)
    if cached is not False:
        return cached  # type: ignore[no-any-return]
    names = set(user.groups.values_list("name", flat=True))  # type: ignore[union-attr]
    role = role_from_groups(names)
    user._tessera_role = role  # type: ignore[union-attr]
    return role


def has_role(user: AbstractBaseUser | AnonymousUser | None, needed: Role) -> bool:
    """Whether the identity holds `needed` (human roles are ranked; `node` only matches itself)."""
    role = role_of(user)
    if role is None:
        return False
    if needed is Role.NODE or role is Role.NODE:
        return role is needed
    return HUMAN_RANK[role] >= HUMAN_RANK[needed]


def ensure_groups() -> dict[Role, Group]:
    return {role: Group.objects.get_or_create(name=role.group_name)[0] for role in Role}
