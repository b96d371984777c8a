"""Per-container GPU usage from the shim's shared regions, as Prometheus metrics.

Every container the plugin configured has ``<state>/owners/<name>.json`` (who it is) and a
region directory ``<region dir>/<name>/`` where the shim keeps its region file. A scrape reads
each region once through :mod:`nodeplugin.shared_region` (the shim engineer's ctypes mirror).
A region that is missing (no CUDA process yet), truncated or garbage is reported as such and
logged once per name and problem; it never stops the scrape or the plugin.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nodeplugin.cards import Card, Health
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


class UsageCollector(Collector):
    def __init__(
        self,
        state_dir: Path,
        region_dir: Path,
        cards: Callable[[], Iterable[tuple[Card, Health]]],
    ) -> None:
        self.state_dir = state_dir
        self.region_dir = region_dir
        self.cards = cards
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

    def collect(self) -> Iterator[Metric]:
        labels = ["namespace", "pod", "container", "uuid", "ordinal"]
        used = GaugeMetricFamily(
            "tessera_container_gpu_memory_used_bytes",
            "Device memory a container's processes hold on a card (from the shim's region)",
            labels=labels,
        )
        limit = GaugeMetricFamily(
            "tessera_container_gpu_memory_limit_bytes",
            "The container's memory limit on a card (0 = none)",
            labels=labels,
        )
        held = GaugeMetricFamily(
            "tessera_container_gpu_launches_held",
            "1 while the container's kernel launches on a card are held for a higher-priority "
            "container on it (task priority; containers with a priority only)",
            labels=labels,
        )
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        bad = GaugeMetricFamily(
            "tessera_container_region_unreadable",
            "1 when the container's shared region exists but is truncated or garbage",
            labels=["namespace", "pod", "container"],
        )
        for u in self.snapshot():
            o = u.owner
            unreadable = u.error not in ("", "absent")
            bad.add_metric([o.namespace, o.pod, o.container], 1.0 if unreadable else 0.0)
            if u.snapshot is None:
                continue
            holding = u.snapshot.hold_mask if u.snapshot.hold_until_ns > now else 0
            for i, uuid in enumerate(o.uuids):
                values = [o.namespace, o.pod, o.container, uuid, str(i)]
                if o.priority is not None:
                    held.add_metric(values, float(holding >> i & 1))
                dev = u.snapshot.device(i)
                if dev is None:
                    continue
                used.add_metric(values, float(dev.used_bytes))
                limit.add_metric(values, float(dev.limit_bytes))
        healthy = GaugeMetricFamily(
            "tessera_card_healthy",
            "1 when the card is advertised as healthy",
            labels=["uuid", "index", "reason"],
        )
        for card, health in self.cards():
            healthy.add_metric(
                [card.uuid, str(card.index), health.reason], 1.0 if health.healthy else 0.0
            )
        yield from (used, limit, held, bad, healthy)
