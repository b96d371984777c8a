"""Owner records: who each configured container is (``<state>/owners/<name>.json``).

:class:`nodeplugin.writer.Writer` writes one per name at ``PreStartContainer``, from the
control plane's record; the metrics and task priority read them here. Standard library only,
so the shim's tests can drive the priority monitor without the plugin's dependencies.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    pod: str
    container: str
    uuids: tuple[str, ...]  # by device ordinal inside the container
    priority: int | None = None  # the record's task priority; None when the pod asked none


def read_owner(path: Path) -> Owner:
    """One owner record (written by :class:`nodeplugin.writer.Writer`); raises OSError,
    ValueError, KeyError or TypeError when it is unreadable."""
    d = json.loads(path.read_bytes())
    priority = d.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise TypeError(f"priority {priority!r} is not an integer")
    return Owner(
        str(d["name"]),
        str(d["namespace"]),
        str(d["pod"]),
        str(d["container"]),
        tuple(str(x["uuid"]) for x in d["devices"]),
        priority,
    )


def owners(state_dir: Path) -> list[Owner]:
    out: list[Owner] = []
    for path in sorted((state_dir / "owners").glob("*.json")):
        try:
            out.append(read_owner(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("owner record %s is unreadable (%s); skipped", path, exc)
    return out
