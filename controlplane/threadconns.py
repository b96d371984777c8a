"""Database connections of the threads an app server ends.

Django keeps a connection per thread and alias (CONN_MAX_AGE > 0) and closes it only at the end
of a request that finds it obsolete or broken. An app server that ends idle worker threads
(granian, which serves the scheduler's extender sidecar, ends blocking threads idle past
`--blocking-threads-idle-timeout`) would leave the connections of those threads open: Django's
connection wrappers sit in reference cycles, which only the garbage collector's next full pass
frees, and an idle process may not run one for a long time. Every idle spell would leak up to a
thread pool's worth of PostgreSQL connections.

`close_with_thread()` ties the thread's open connections to a thread-local sentinel;
`ClosedWithThread` wraps a WSGI application to call it after every request
(controlplane/wsgi.py). A thread's locals are freed when it ends; the sentinel then closes the
driver connections it holds, at once and in the ending thread itself.

Why not Django's own PostgreSQL pool (`OPTIONS["pool"]`, psycopg_pool): after a server restart
or failover every connection in the pool is dead, and psycopg_pool checks them one by one,
sleeping with exponential backoff (1 s, 2 s, 4 s, ...) after each failed check before trying
the next. With the pool grown to 32 connections by a burst, the first request after a restart
waited out the pool's 30 s timeout and answered 500 (psycopg_pool 3.3.3; measured by
tests/extender/test_database_restart_pg.py after the 64-thread bind test filled the pool). A
thread's own connection with CONN_HEALTH_CHECKS is found dead on the request's first statement
and replaced at once. For the bind path the pool measured the same as this within noise
(bench_extender at 1,000 nodes, 10 mirrored pairs: bind p50 ratio 0.99).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from django.db import connections

log = logging.getLogger(__name__)


class _CloseAtThreadEnd:
    __slots__ = ("wrappers",)

    def __init__(self) -> None:
        self.wrappers: dict[str, Any] = {}

    def __del__(self) -> None:
        for alias, wrapper in self.wrappers.items():
            raw = getattr(wrapper, "connection", None)
            if raw is not None:
                with contextlib.suppress(Exception):  # a broken one is as good as closed
                    raw.close()
                    log.debug("closed the %s connection of an ended thread", alias)


_local = threading.local()


def close_with_thread() -> None:
    """Have this thread's open database connections closed when the thread ends."""
    sentinel = getattr(_local, "sentinel", None)
    if sentinel is None:
        sentinel = _local.sentinel = _CloseAtThreadEnd()
    for wrapper in connections.all(initialized_only=True):
        sentinel.wrappers[wrapper.alias] = wrapper


class ClosedWithThread:
    """WSGI middleware: after every request, `close_with_thread()` on the thread that served it."""

    def __init__(self, application: Callable[..., Iterable[bytes]]) -> None:
        self.application = application

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        try:
            return self.application(environ, start_response)
        finally:
            close_with_thread()
