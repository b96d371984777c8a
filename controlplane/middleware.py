"""Refuse oversized request bodies before any view or parser reads them.

Django enforces DATA_UPLOAD_MAX_MEMORY_SIZE only when something reads `request.body`; DRF's
parsers read the stream directly, so the limit is applied here, by the declared length.
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse


class BodySizeLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        raw = request.META.get("CONTENT_LENGTH") or "0"
        try:
            length = int(raw)
        except ValueError:
            return JsonResponse({"error": f"Content-Length {raw!r} is not a number."}, status=400)
        if limit is not None and length > limit:
            return JsonResponse(
                {
                    "error": f"body: {length} bytes is over the limit of {limit} bytes; "
                    "send a smaller request.",
                    "fields": {"body": f"at most {limit} bytes"},
                },
                status=413,
            )
        return self.get_response(request)
