"""Per-container GPU usage from the shim's shared regions (for :mod:`nodeplugin.metrics`).

Every container the plugin configured has ``<state>/owners/<name>.json`` (who it is) and a
region directory ``<region dir>/<name>/`` where the shim keeps its region file. A sample reads
each region once through :mod:`nodeplugin.shared_region` (the shim engineer's ctypes mirror).
A region that is missing (no CUDA process yet), truncated or garbage is reported as such and
logged once per name and problem; it never stops the scrape or the plugin.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from nodeplugin.edits import REGION_FILE
from nodeplugin.owners import Owner, owners
from nodeplugin.shared_region import RegionError, RegionSnapshot, read_region

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContainerUsage:
    owner: Owner
    snapshot: RegionSnapshot | None
    error: str  # '' when the snapshot is good, 'absent' when no region yet


def read_usage(owner: Owner, region_dir: Path) -> ContainerUsage:
    path = region_dir / owner.name / REGION_FILE
    try:
        return ContainerUsage(owner, read_region(path), "")
    except FileNotFoundError:
        return ContainerUsage(owner, None, "absent")
    except (RegionError, OSError) as exc:
        return ContainerUsage(owner, None, f"region file {path} is unusable: {exc}")


class UsageReader:
    """Reads every configured container's region; logs a bad one once per name and problem."""

    def __init__(self, state_dir: Path, region_dir: Path) -> None:
        self.state_dir = state_dir
        self.region_dir = region_dir
        self._logged: set[tuple[str, str]] = set()

    def snapshot(self) -> list[ContainerUsage]:
        result = [read_usage(o, self.region_dir) for o in owners(self.state_dir)]
        for u in result:
            key = (u.owner.name, u.error)
            if u.error and u.error != "absent" and key not in self._logged:
                self._logged.add(key)
                log.error(
                    "%s/%s container %s: %s",
                    u.owner.namespace,
                    u.owner.pod,
                    u.owner.container,
                    u.error,
                )
        return result
