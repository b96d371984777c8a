"""DRF permissions by Tessera role (see controlplane.access.roles)."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from controlplane.access.roles import Role, has_role


class _RolePermission(BasePermission):
    role: Role

    def has_permission(self, request: Request, view: Any) -> bool:
        return has_role(request.user, self.role)


class IsViewer(_RolePermission):
    role = Role.VIEWER
    message = "This needs the viewer role or higher."


class IsOperator(_RolePermission):
    role = Role.OPERATOR
    message = "This needs the operator role or higher."


class IsAdmin(_RolePermission):
    role = Role.ADMIN
    message = "This needs the admin role."


class IsNode(_RolePermission):
    role = Role.NODE
    message = "This needs a node identity (a node plugin's token)."
