"""OPTIONS answers: what a view renders and parses, and the fields the caller may send.

DRF's SimpleMetadata, for a caller allowed to PUT, fetches the object with `view.get_object()`
to check object permissions. Tessera's views have no queryset (a service finds and locks the
object), so that lookup raised AssertionError and OPTIONS on an object route answered 500 to
every role that may write. Object permissions are not used here: the role check is the whole
check, and the field list comes from the serializer alone.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import Http404
from rest_framework import exceptions
from rest_framework.metadata import SimpleMetadata
from rest_framework.request import Request, clone_request


class Metadata(SimpleMetadata):
    def determine_actions(self, request: Request, view: Any) -> dict[str, Any]:
        actions: dict[str, Any] = {}
        for method in sorted({"PUT", "POST"} & set(view.allowed_methods)):
            view.request = clone_request(request, method)
            try:
                view.check_permissions(view.request)
            except (exceptions.APIException, PermissionDenied, Http404):
                continue
            finally:
                view.request = request
            actions[method] = self.get_serializer_info(view.get_serializer())
        return actions
