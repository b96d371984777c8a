"""One error shape for the whole API: what went wrong, which field, and how to fix it.

    {"error": "<one sentence>", "fields": {"cards[1].memory_mib": "<message>", ...}}

No traceback ever reaches a caller; unexpected errors are logged and answered with a 500 that
says only that.
"""

from __future__ import annotations

import logging
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane.ledger.errors import ServiceError

log = logging.getLogger(__name__)


def flatten(detail: Any, prefix: str = "") -> dict[str, str]:
    """Turn DRF's nested error detail into {"a.b[2].c": "message"}."""
    out: dict[str, str] = {}
    if isinstance(detail, dict):
        for key, value in detail.items():
            name = "" if key == "non_field_errors" else str(key)
            if isinstance(key, int) or name.isdigit():  # DRF keys list items by position
                name = f"[{name}]"
            if name.startswith("["):
                path = f"{prefix}{name}"
            else:
                path = f"{prefix}.{name}" if prefix and name else (prefix or name)
            out.update(flatten(value, path))
    elif isinstance(detail, list):
        if all(not isinstance(v, dict | list) for v in detail):
            out[prefix or "body"] = " ".join(str(v) for v in detail)
        else:
            for i, value in enumerate(detail):
                if value:
                    out.update(flatten(value, f"{prefix}[{i}]"))
    else:
        out[prefix or "body"] = str(detail)
    return out


def error_response(message: str, code: int, fields: dict[str, str] | None = None) -> Response:
    body: dict[str, Any] = {"error": message}
    if fields:
        body["fields"] = fields
    return Response(body, status=code)


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, ServiceError):
        fields = {exc.field: exc.message} if exc.field else None
        return error_response(exc.message, exc.status, fields)
    if isinstance(exc, exceptions.ValidationError):
        fields = flatten(exc.detail)
        first = next(iter(fields.items()))
        return error_response(f"{first[0]}: {first[1]}", status.HTTP_400_BAD_REQUEST, fields)
    if isinstance(exc, exceptions.ParseError):
        return error_response(
            f"body: {exc.detail} Send a JSON object with Content-Type: application/json.",
            status.HTTP_400_BAD_REQUEST,
            {"body": str(exc.detail)},
        )
    if isinstance(exc, exceptions.APIException):
        response = drf_exception_handler(exc, context)
        if response is not None:
            response.data = {"error": str(exc.detail)}
        return response
    if isinstance(exc, Http404):
        return error_response("Not found.", status.HTTP_404_NOT_FOUND)
    log.exception("unhandled error in %s", context.get("view"))
    return error_response("Internal error; the server log has the details.", 500)


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 404 for a path no route matches: the API's error body under /api/ (a client of
    the API reads JSON, also for a name with an encoded '/' that fits no route), the HTML page
    elsewhere."""
    if request.path.startswith("/api/"):
        return JsonResponse({"error": f"Not found: no API route for {request.path}."}, status=404)
    return defaults.page_not_found(request, exception or Http404())
