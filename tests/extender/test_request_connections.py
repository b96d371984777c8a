"""A request gives its database connection back when it ends: no thread holds one between
requests, so a thread an app server ends (granian ends idle blocking threads of the extender
sidecar) leaves no connection open behind it (PostgreSQL: back in Django's connection pool;
SQLite: closed)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection

from tests.extender.builders import filter_args
from tests.extender.test_fastpath import call
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db(transaction=True)


def _in_thread(path: str, body: Any = b"", method: str = "POST") -> dict[str, Any]:
    """Serve one request on a thread of its own, as an app server's worker thread does; what
    the thread's connection was after it."""
    seen: dict[str, Any] = {}

    def work() -> None:
        seen["status"] = call(path, body, method=method)[0]
        seen["held"] = connection.connection

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return seen


def test_a_request_through_django_leaves_its_thread_no_connection() -> None:
    seen = _in_thread("/readyz", method="GET")  # through Django, not the fast path: it queries
    assert seen["status"].startswith("200")
    assert seen["held"] is None


def test_an_extender_verb_leaves_its_thread_no_connection() -> None:
    seen = _in_thread("/scheduler/filter", filter_args(gpu_pod("p"), ["n1"]))  # the fast path
    assert seen["status"].startswith("200")
    assert seen["held"] is None
