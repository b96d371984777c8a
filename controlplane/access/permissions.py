"""DRF permissions by Tessera role (see controlplane.access.roles): the one place an API view
finds who may call it."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from controlplane.access.roles import Role, has_role


class _AnyOfRoles(BasePermission):
    """Granted to an identity that holds any of ``roles`` (human roles ranked, ``node`` only
    itself, as `has_role` says); refused with ``message``, which names what is needed."""

    roles: tuple[Role, ...]

    def has_permission(self, request: Request, view: Any) -> bool:
        return any(has_role(request.user, role) for role in self.roles)


class IsViewer(_AnyOfRoles):
    roles = (Role.VIEWER,)
    message = "This needs the viewer role or higher."


class IsNodeOrViewer(_AnyOfRoles):
    roles = (Role.NODE, Role.VIEWER)
    message = "This needs a node identity or the viewer role."


class IsNodeOrAdmin(_AnyOfRoles):
    roles = (Role.NODE, Role.ADMIN)
    message = "This needs a node identity (a node plugin's token) or the admin role."
