"""Connections of threads an app server ends are closed when the thread ends
(`controlplane.threadconns`; granian ends idle blocking threads of the extender sidecar)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connections

from controlplane.threadconns import close_with_thread

pytestmark = pytest.mark.django_db(transaction=True)


def _is_open(raw: Any) -> bool:
    if hasattr(raw, "closed"):  # psycopg
        return not raw.closed
    try:  # sqlite3
        raw.execute("SELECT 1")
    except Exception:
        return False
    return True


def _in_thread(register: bool) -> tuple[Any, Any]:
    """(wrapper, driver connection) a thread used for one query, then ended."""
    seen: dict[str, Any] = {}

    def work() -> None:
        wrapper = connections["default"]
        with wrapper.cursor() as cursor:
            cursor.execute("SELECT 1")
        seen["wrapper"], seen["raw"] = wrapper, wrapper.connection
        if register:
            close_with_thread()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return seen["wrapper"], seen["raw"]


def test_the_connection_of_an_ended_thread_is_closed() -> None:
    _, raw = _in_thread(register=True)
    assert not _is_open(raw)


def test_without_it_the_ended_thread_leaves_its_connection_open() -> None:
    wrapper, raw = _in_thread(register=False)  # the wrapper held here, as a reference cycle would
    try:
        assert _is_open(raw)
    finally:
        raw.close()
        del wrapper


def test_repeated_calls_keep_one_sentinel_per_thread() -> None:
    close_with_thread()
    close_with_thread()
    from controlplane import threadconns

    sentinel = threadconns._local.sentinel
    assert set(sentinel.wrappers) == {w.alias for w in connections.all(initialized_only=True)}


def test_the_production_application_ties_every_requests_connections_to_its_thread() -> None:
    from controlplane import threadconns
    from tests.extender.test_fastpath import call

    seen: dict[str, Any] = {}

    def work() -> None:
        seen["status"] = call("/readyz", method="GET")[0]  # through Django, not the fast path
        sentinel = getattr(threadconns._local, "sentinel", None)
        seen["tied"] = set(sentinel.wrappers) if sentinel is not None else set()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["status"].startswith("200")
    assert "default" in seen["tied"]
