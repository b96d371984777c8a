"""The extender's four verbs straight to their views, around Django's request machinery.

kube-scheduler calls filter and prioritize for every pod, one pod after another, and bind for
every placed pod: three requests per pod on the scheduler's sidecar (preempt only when it
preempts). Django's middleware stack and its request signals cost about 0.2 ms of CPU per
request there, a tenth of the sidecar's work, for nothing these machine endpoints use
(sessions, CSRF, authentication, static files, security headers for browsers).
`ExtenderFastPath` wraps the WSGI application: the exact paths of `/scheduler/filter`,
`/scheduler/prioritize`, `/scheduler/bind` and `/scheduler/preempt` go to the same view
functions the URLconf names (so the same guards answer: extender served here, loopback peer,
POST, body limit), everything else to Django unchanged. It does the part of Django's request
cycle that matters to them: database connections past their age or broken are closed after the
request, as `request_finished` would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from django.core.handlers.wsgi import WSGIRequest
from django.db import close_old_connections

from controlplane.extender.urls import urlpatterns

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

# The extender's routes as the URLconf names them (mounted at the root): one list of paths.
ROUTES = {
    f"/{pattern.pattern}": pattern.callback
    for pattern in urlpatterns
    if pattern.name and pattern.name.startswith("extender-")
}

_FAILED = b'{"Error":"internal error in the extender; the control plane log has it"}'


class ExtenderFastPath:
    def __init__(self, application: WSGIApp) -> None:
        self.application = application

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        view = ROUTES.get(environ.get("PATH_INFO", ""))
        if view is None or environ.get("SCRIPT_NAME"):
            return self.application(environ, start_response)
        try:
            response = view(WSGIRequest(environ))
        except Exception:  # the views answer their own errors; this is a bug in between
            log.exception("extender fast path %s failed", environ.get("PATH_INFO"))
            start_response(
                "500 Internal Server Error",
                [("Content-Type", "application/json"), ("Content-Length", str(len(_FAILED)))],
            )
            return [_FAILED]
        finally:
            close_old_connections()
        content = response.content
        headers = [
            *response.items(),
            ("Content-Length", str(len(content))),  # as CommonMiddleware sets it: keep-alive
            ("X-Content-Type-Options", "nosniff"),
        ]
        start_response(f"{response.status_code} {response.reason_phrase}", headers)
        return [content]
