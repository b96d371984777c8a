"""Django's PostgreSQL backend with a connection check that survives a server restart.

The settings run PostgreSQL through Django's connection pool (psycopg_pool): a request takes a
connection when it first queries and gives it back when it ends. A server restart or failover
ends every connection the pool holds. psycopg_pool's own check (what CONN_HEALTH_CHECKS
installs) finds them dead one at a time and sleeps after each with exponential backoff (1 s,
2 s, 4 s, ...): with a burst's 32 connections pooled, the first request after a restart waited
out the pool's 30 s timeout and answered 500 (psycopg_pool 3.3.3). Django passes the pool its
own `check` argument, so a different check cannot be given through `OPTIONS["pool"]`.

This backend checks the connection it takes from the pool itself (the same empty statement as
psycopg_pool's check, so one round trip per request as before). A dead one goes back to the
pool, which closes it and opens another, and the pool checks every idle connection at once
(`ConnectionPool.check`, its public method), so the request waits only for a new connection
and the requests after it find live ones. tests/extender/test_database_restart_pg.py measures it.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool

log = logging.getLogger(__name__)

# A connection another request gives back after the restart, without having used it, can still
# be dead after the pool was checked: try again, a few times at most.
ATTEMPTS = 3


def is_alive(connection: psycopg.Connection[Any]) -> bool:
    try:
        ConnectionPool.check_connection(connection)
    except psycopg.Error:
        return False
    return True


class DatabaseWrapper(base.DatabaseWrapper):
    def get_new_connection(self, conn_params: dict[str, Any]) -> Any:
        connection = super().get_new_connection(conn_params)
        pool = self.pool
        if pool is None:
            return connection
        for _ in range(ATTEMPTS):
            if is_alive(connection):
                return connection
            log.warning("a pooled database connection is dead: checking every pooled one")
            pool.putconn(connection)
            pool.check()
            connection = super().get_new_connection(conn_params)
        return connection
