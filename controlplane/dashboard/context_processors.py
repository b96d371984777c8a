"""Template context: the signed-in identity's role, so pages show only the controls it may use."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest

from controlplane.access.roles import Role, has_role, role_of


def tessera_role(request: HttpRequest) -> dict[str, Any]:
    """`tessera_role` (name or None), `can_operate` (operator+), `can_admin` (admin)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {"tessera_role": None, "can_operate": False, "can_admin": False}
    role = role_of(user)
    return {
        "tessera_role": role.value if role else None,
        "can_operate": has_role(user, Role.OPERATOR),
        "can_admin": has_role(user, Role.ADMIN),
    }
