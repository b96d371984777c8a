"""A guard on the ledger's rows: every write must come from `controlplane/ledger/services/`.

Installed for every database test (tests/conftest.py): it watches the statements of the test's
connection, and for each INSERT, UPDATE or DELETE of a ledger table it looks at the Python stack.
The innermost control-plane frame that is not the ledger's own plumbing (the models' stamp,
the hand-written SQL, rawsql) must be a ledger service; code of the tests themselves (building
rows directly) is no control-plane frame and is let through.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.apps import apps
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent
CONTROLPLANE = str(ROOT / "controlplane") + "/"
SERVICES = CONTROLPLANE + "ledger/services/"
PLUMBING = {
    CONTROLPLANE + "ledger/models.py",
    CONTROLPLANE + "ledger/sql.py",
    CONTROLPLANE + "rawsql.py",
}
_WRITE = re.compile(r'\b(?:INSERT\s+INTO|DELETE\s+FROM|UPDATE)\s+"?(\w+)"?', re.IGNORECASE)
_FOR_UPDATE = re.compile(r"\bFOR\s+UPDATE\b", re.IGNORECASE)


def ledger_tables() -> frozenset[str]:
    return frozenset(m._meta.db_table for m in apps.get_app_config("ledger").get_models())


def written_tables(sql: str) -> set[str]:
    """The tables a statement writes (a row lock, SELECT ... FOR UPDATE, writes none)."""
    return {t.lower() for t in _WRITE.findall(_FOR_UPDATE.sub("", sql))}


def writer_of_this_call() -> str | None:
    """The file of the innermost control-plane frame outside the ledger's plumbing."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(CONTROLPLANE) and filename not in PLUMBING:
            return filename
        frame = frame.f_back  # type: ignore[assignment]
    return None


@dataclass
class Guard:
    tables: frozenset[str]
    violations: list[str] = field(default_factory=list)
    by_services: list[str] = field(default_factory=list)  # files of the services that wrote

    def __call__(self, execute: Callable[..., Any], sql: str, params: Any, many: bool,
                 context: dict[str, Any]) -> Any:  # fmt: skip
        touched = written_tables(sql) & self.tables
        if touched:
            writer = writer_of_this_call()
            if writer is not None:
                if writer.startswith(SERVICES):
                    self.by_services.append(writer.removeprefix(SERVICES))
                else:
                    where = writer.removeprefix(str(ROOT) + "/")
                    self.violations.append(f"{where} writes {', '.join(sorted(touched))}")
        return execute(sql, params, many, context)


@contextmanager
def guarded() -> Iterator[Guard]:
    """Watch this thread's default connection for ledger writes from outside the services."""
    guard = Guard(ledger_tables())
    with connection.execute_wrapper(guard):
        yield guard
