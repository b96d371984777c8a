"""Role checks for dashboard pages (the REST API uses controlplane.access.permissions).

Anonymous visitors are sent to the login page; a signed-in identity without the role gets 403,
never a redirect loop. Node identities hold no human role, so they see no page.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from controlplane.access.roles import Role, has_role, role_of

View = Callable[..., HttpResponse]


def role_required(role: Role) -> Callable[[View], View]:
    """Decorate a page view: login required, then `role` or higher."""

    def decorate(view: View) -> View:
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                if request.headers.get("HX-Request") == "true":
                    # A poll after the session expired: send the whole tab to the login page
                    # instead of swapping the login form into the polled fragment.
                    page = request.headers.get("HX-Current-URL") or request.path
                    login = redirect_to_login(page)
                    response = HttpResponse(status=204)
                    response["HX-Redirect"] = login["Location"]
                    return response
                return redirect_to_login(request.get_full_path())
            if not has_role(request.user, role):
                return forbidden(request, role)
            return view(request, *args, **kwargs)

        return wrapped

    return decorate


def forbidden(request: HttpRequest, role: Role) -> HttpResponse:
    """The 403 page: which role the action needs and which one the user holds."""
    held = role_of(request.user)
    return render(
        request,
        "dashboard/forbidden.html",
        {"needed": role.value, "held": held.value if held else "none"},
        status=403,
    )
