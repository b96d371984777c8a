"""A throw-away database for one run: SQLite in a folder, or a fresh PostgreSQL database.

The end-to-end suite and the benchmarks run the control plane on a database nobody else uses,
so a run never meets rows an earlier one left behind: on PostgreSQL a database of its own
(``<base name>_<tag>_<pid>``) is created on the given server and dropped at the end.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path


class ScratchDatabase:
    """`url` is the database to give the control plane; `drop()` removes it (PostgreSQL)."""

    def __init__(self, base_url: str | None, tmp: Path, tag: str = "bench") -> None:
        self.admin_url = None
        if base_url:
            parts = urllib.parse.urlsplit(base_url)
            self.name = f"{parts.path.lstrip('/') or 'tessera'}_{tag}_{os.getpid()}"
            self.url = urllib.parse.urlunsplit(parts._replace(path=f"/{self.name}"))
            # CREATE/DROP DATABASE run from the server's maintenance database
            self.admin_url = urllib.parse.urlunsplit(parts._replace(path="/postgres"))
            self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            self._admin(f'CREATE DATABASE "{self.name}"')
        else:
            self.url = f"sqlite:///{tmp / f'{tag}.sqlite3'}"

    @property
    def postgres(self) -> bool:
        return self.admin_url is not None

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql)

    def drop(self) -> None:
        if self.admin_url:
            self._admin(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
