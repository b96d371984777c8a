"""The node plugin's Prometheus metrics: NVML's figures per card, the shim's usage per container.

A scrape never calls NVML or reads a region: NVML calls block (a lost card can take seconds)
and a node has up to 8 cards x 50 containers. A thread (:class:`Sampler`) reads everything every
``TESSERA_METRICS_INTERVAL_S`` and swaps in a finished set of families; a scrape hands out the
latest one.

Every family is defined once, in :data:`FAMILIES`; docs/nodeplugin.md lists them with their
DCGM counterparts, and the dashboard test checks Grafana's queries against this table.

Per-container compute comes from NVML's per-process utilisation: NVML names host pids, the
shim's region records each process by its pid inside the container and its start time (clock
ticks since boot, the same in every pid namespace). ``/proc/<host pid>/status`` (NSpid) and
``/proc/<host pid>/stat`` give both for a host pid, so a sample belongs to the container whose
region holds that pair. A pair two containers hold is left out, never guessed. Where NVML
cannot give samples (MIG cards, older drivers) the shim's launch counter stands in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nodeplugin.allocation import SHARED
from nodeplugin.cards import Card, Health
from nodeplugin.config import MAX_OVERSUBSCRIPTION
from nodeplugin.nvml import Nvml, NvmlError, ProcessSample
from nodeplugin.owners import Owner
from nodeplugin.usage import ContainerUsage, UsageReader

log = logging.getLogger(__name__)

CARD_LABELS = ("node", "card", "index", "model", "mode")
CONTAINER_LABELS = ("namespace", "pod", "container", "uuid", "ordinal")
WHO_LABELS = ("namespace", "pod", "container")


@dataclass(frozen=True)
class Definition:
    """One metric family: its name (a counter's without ``_total``), kind, help and labels."""

    name: str
    kind: str  # "gauge" or "counter"
    doc: str
    labels: tuple[str, ...]


_DEFS = (
    # -- per card, from NVML --
    Definition(
        "tessera_card_gpu_utilization_percent",
        "gauge",
        "Percent of the last sample period in which a kernel ran on the card (NVML)",
        CARD_LABELS,
    ),
    Definition(
        "tessera_card_memory_used_bytes",
        "gauge",
        "Device memory in use on the card as NVML sees it (all processes, any owner)",
        CARD_LABELS,
    ),
    Definition(
        "tessera_card_memory_total_bytes",
        "gauge",
        "Device memory of the card as NVML sees it",
        CARD_LABELS,
    ),
    Definition(
        "tessera_card_temperature_celsius", "gauge", "GPU core temperature (NVML)", CARD_LABELS
    ),
    Definition(
        "tessera_card_power_watts",
        "gauge",
        "Power the card draws, board total (NVML)",
        CARD_LABELS,
    ),
    Definition(
        "tessera_card_xid_errors",
        "counter",
        "XID errors the card reported through NVML events, those ignored for health too "
        "(cards whose XID events NVML delivers)",
        CARD_LABELS,
    ),
    Definition(
        "tessera_card_nvml_read_errors",
        "counter",
        "Reads of a figure NVML refused on the card (that figure's series is left out then)",
        (*CARD_LABELS, "figure"),
    ),
    Definition(
        "tessera_card_healthy",
        "gauge",
        "1 when the card is advertised as healthy",
        ("uuid", "index", "reason"),
    ),
    # -- per container, from the shim's region and NVML --
    Definition(
        "tessera_container_gpu_memory_used_bytes",
        "gauge",
        "Device memory a container's processes hold on a card (from the shim's region)",
        CONTAINER_LABELS,
    ),
    Definition(
        "tessera_container_gpu_memory_resident_bytes",
        "gauge",
        "Of a container's device memory on a card, what is held on the card: all of it, but for "
        "an oversubscribed slice, whose part served as managed memory past its resident part "
        "may be in host memory (from the shim's region)",
        CONTAINER_LABELS,
    ),
    Definition(
        "tessera_container_gpu_memory_spilled_bytes",
        "gauge",
        "Of a container's device memory on a card, what the shim served as managed memory past "
        "the slice's resident part: the most the driver can have moved to host memory (from the "
        "shim's region; 0 for a slice that is not oversubscribed)",
        CONTAINER_LABELS,
    ),
    Definition(
        "tessera_container_gpu_memory_limit_bytes",
        "gauge",
        "The container's memory limit on a card (0 = none)",
        CONTAINER_LABELS,
    ),
    Definition(
        "tessera_container_gpu_compute_share_percent",
        "gauge",
        "The container's compute share of a card, percent of its SMs (0 = none)",
        CONTAINER_LABELS,
    ),
    Definition(
        "tessera_container_gpu_sm_utilization_percent",
        "gauge",
        "Percent of the card's SM time the container's processes used in the last sample "
        "period (NVML per-process utilisation)",
        CONTAINER_LABELS,
    ),
    Definition(
        "tessera_container_gpu_launches",
        "counter",
        "Kernel launches the container made on a card, as the shim counts them (counted only "
        "for containers with a task priority)",
        CONTAINER_LABELS,
    ),
    Definition(
        "tessera_container_gpu_launches_held",
        "gauge",
        "1 while the container's kernel launches on a card are held for a higher-priority "
        "container on it (task priority; containers with a priority only)",
        CONTAINER_LABELS,
    ),
    Definition(
        "tessera_container_region_unreadable",
        "gauge",
        "1 when the container's shared region exists but is truncated or garbage",
        WHO_LABELS,
    ),
    Definition(
        "tessera_metrics_sample_seconds",
        "gauge",
        "Time the node plugin took to read NVML and the regions for its latest sample",
        (),
    ),
)
FAMILIES: Mapping[str, Definition] = {d.name: d for d in _DEFS}

_CARD_GAUGES = {
    "utilization": "tessera_card_gpu_utilization_percent",
    "memory_used": "tessera_card_memory_used_bytes",
    "memory_total": "tessera_card_memory_total_bytes",
    "temperature": "tessera_card_temperature_celsius",
    "power": "tessera_card_power_watts",
}


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    out: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for d in _DEFS:
        cls = GaugeMetricFamily if d.kind == "gauge" else CounterMetricFamily
        out[d.name] = cls(d.name, d.doc, labels=list(d.labels))
    return out


def host_process(proc_root: Path, pid: int) -> tuple[int, int] | None:
    """(pid in its innermost pid namespace, start time in clock ticks) of host pid ``pid``;
    None when the process is gone or its files cannot be read."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
        status = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces; start time is field 22.
    fields = stat.rpartition(")")[2].split()
    if len(fields) < 20:
        return None
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            nspids = line.split()[1:]
            try:
                return int(nspids[-1]), int(fields[19])
            except (IndexError, ValueError):
                return None
    return None


def container_compute(
    usages: Iterable[ContainerUsage],
    samples: Mapping[str, list[ProcessSample]],
    whose: Callable[[int], tuple[int, int] | None],
) -> dict[tuple[str, int], float]:
    """SM percent per (container name, device ordinal) on the cards in ``samples`` (those whose
    per-process utilisation NVML gave): every container with a readable region on such a card
    gets a figure, 0 when none of its processes ran."""
    by_process: dict[tuple[int, int, str], list[tuple[str, int]]] = {}
    out: dict[tuple[str, int], float] = {}
    for u in usages:
        if u.snapshot is None:
            continue
        for ordinal, uuid in enumerate(u.owner.uuids):
            if uuid not in samples:
                continue
            out[(u.owner.name, ordinal)] = 0.0
            for p in u.snapshot.processes:
                by_process.setdefault((p.pid, p.start_time, uuid), []).append(
                    (u.owner.name, ordinal)
                )
    for uuid, card_samples in samples.items():
        # A process can have several samples in a period: its share is their mean.
        per_pid: dict[int, list[int]] = {}
        for s in card_samples:
            per_pid.setdefault(s.pid, []).append(s.sm_percent)
        for pid, values in per_pid.items():
            ident = whose(pid)
            if ident is None:
                continue
            holders = by_process.get((ident[0], ident[1], uuid), [])
            if len(holders) != 1:
                continue  # nobody's, or ambiguous between containers: not guessed
            key = holders[0]
            out[key] = min(100.0, out[key] + sum(values) / len(values))
    return out


@dataclass(frozen=True)
class Used:
    """One container's use of one card in a sample."""

    owner: Owner
    uuid: str
    memory_bytes: int
    compute_percent: float | None  # None: NVML gave no sample of its processes
    spilled_bytes: int = 0  # of memory_bytes: past the resident part (virtual device memory)


MIB = 1024 * 1024


def _mib(n: int) -> int:
    return max(0, -(-n // MIB))  # a byte held shows as 1 MiB, not 0


def usage_entries(
    used: Iterable[Used],
    cards: Mapping[str, int],
    *,
    spill: bool = False,
    host_mib: int | None = None,
) -> list[dict[str, object]]:
    """The inventory report's `usage` (docs/nodeplugin.md): one entry per container and card of
    this node (`cards`: UUID -> memory MiB). The region is the container's to write, so its
    figures are held to what the node has: what is on the card to the card's memory, what is
    spilled to the node's memory (`host_mib`) and to the largest factor's share of the card,
    so a forged one cannot get the report refused or pass for more than there is. Two records
    of one container (a restarted container whose old record the collector has not dropped
    yet) become one entry, the one that holds more memory: the old one's processes are gone.
    With `spill` (a node that oversubscribes) each entry also says how much is resident and
    how much spilled."""
    best: dict[tuple[str, str, str, str], Used] = {}
    for u in used:
        if u.uuid not in cards:
            continue
        key = (u.owner.namespace, u.owner.pod, u.owner.container, u.uuid)
        if key not in best or u.memory_bytes > best[key].memory_bytes:
            best[key] = u
    out: list[dict[str, object]] = []
    for u in best.values():
        # Only a node that oversubscribes has slices that may spill; a slice is at most the
        # largest factor times the card.
        spilled = min(u.spilled_bytes, u.memory_bytes) if spill else 0
        spill_cap = cards[u.uuid] * MAX_OVERSUBSCRIPTION
        if host_mib is not None:
            spill_cap = min(spill_cap, host_mib)
        resident_mib = min(_mib(u.memory_bytes - spilled), cards[u.uuid])
        spilled_mib = min(_mib(spilled), spill_cap)
        entry: dict[str, object] = {
            "namespace": u.owner.namespace,
            "pod": u.owner.pod,
            "container": u.owner.container,
            "card": u.uuid,
            "memory_used_mib": min(_mib(u.memory_bytes), cards[u.uuid] + spilled_mib),
            "compute_used_percent": None
            if u.compute_percent is None
            else max(0, min(100, round(u.compute_percent))),
        }
        if spill:
            entry["memory_resident_mib"] = resident_mib
            entry["memory_spilled_mib"] = spilled_mib
        out.append(entry)
    return out


class Sampler(threading.Thread):
    """Reads NVML and the regions every ``interval_s``; :meth:`latest` is the last result."""

    def __init__(
        self,
        nvml: Nvml,
        cards: list[Card],
        *,
        node: str,
        usage: UsageReader,
        proc_root: Path,
        interval_s: float,
        modes: Callable[[], Mapping[str, str]],
        health: Callable[[], Mapping[str, Health]],
        xids: Callable[[], Mapping[str, int]],
        spill: bool = False,
        host_mib: int | None = None,
    ) -> None:
        super().__init__(name="metrics", daemon=True)
        self.nvml = nvml
        self.cards = cards
        self.node = node
        self.usage = usage
        self.proc_root = proc_root
        self.interval_s = interval_s
        self.modes = modes
        self.health = health
        self.xids = xids
        self.spill = spill  # the node oversubscribes: usage says what is resident and spilled
        self.host_mib = host_mib
        self.read_errors: dict[tuple[str, str], int] = {}
        self.last_seen_us: dict[str, int] = {}
        self._latest: list[Metric] = []
        self._latest_usage: list[dict[str, object]] | None = None
        self._lock = threading.Lock()
        self._stop_flag = threading.Event()

    def latest(self) -> list[Metric]:
        with self._lock:
            return self._latest

    def latest_usage(self) -> list[dict[str, object]] | None:
        """The last sample's usage per container and card, as the inventory report's `usage`
        carries it; None before the first sample and after a failed one (not known)."""
        with self._lock:
            return self._latest_usage

    def stop(self) -> None:
        self._stop_flag.set()

    def run(self) -> None:
        while not self._stop_flag.is_set():
            usage: list[dict[str, object]] | None
            try:
                families, usage = self.sample()
            except Exception:
                # The device plugin must outlive a fault in its metrics, and old figures must
                # not pass for new ones: the scrape is empty until a sample succeeds again.
                log.exception("metrics sample failed; /metrics is empty until one succeeds")
                families, usage = [], None
            with self._lock:
                self._latest = families
                self._latest_usage = usage
            self._stop_flag.wait(self.interval_s)

    def _process_samples(self) -> dict[str, list[ProcessSample]]:
        out: dict[str, list[ProcessSample]] = {}
        for card in self.cards:
            try:
                got = self.nvml.process_utilization(card.uuid, self.last_seen_us.get(card.uuid, 0))
            except NvmlError as exc:
                self._count_error(card.uuid, "process_utilization")
                log.debug("%s", exc)
                continue
            if got:
                self.last_seen_us[card.uuid] = max(s.timestamp_us for s in got)
            out[card.uuid] = got
        return out

    def _count_error(self, uuid: str, figure: str) -> None:
        key = (uuid, figure)
        self.read_errors[key] = self.read_errors.get(key, 0) + 1

    def sample(self) -> tuple[list[Metric], list[dict[str, object]]]:
        """One reading: the metric families, and the usage entries the heartbeat carries."""
        started = time.monotonic()
        fam = _families()
        modes = self.modes()
        xids = self.xids()
        health = self.health()
        labels: dict[str, list[str]] = {}
        for card in self.cards:
            labels[card.uuid] = [
                self.node,
                card.uuid,
                str(card.index),
                card.model,
                modes.get(card.uuid, SHARED),
            ]
            figures, failed = self.nvml.figures(card.uuid)
            for name, value in figures.items():
                fam[_CARD_GAUGES[name]].add_metric(labels[card.uuid], value)
            for name in failed:
                self._count_error(card.uuid, name)
            if card.uuid in xids:
                fam["tessera_card_xid_errors"].add_metric(labels[card.uuid], float(xids[card.uuid]))
            h = health.get(card.uuid, Health(True))
            fam["tessera_card_healthy"].add_metric(
                [card.uuid, str(card.index), h.reason], 1.0 if h.healthy else 0.0
            )
        processes = self._process_samples()
        for (uuid, figure), count in sorted(self.read_errors.items()):
            if uuid in labels:
                fam["tessera_card_nvml_read_errors"].add_metric(
                    [*labels[uuid], figure], float(count)
                )
        usages = self.usage.snapshot()
        compute = container_compute(
            usages, processes, lambda pid: host_process(self.proc_root, pid)
        )
        usage = usage_entries(
            self._containers(fam, usages, compute),
            {c.uuid: c.memory_mib for c in self.cards},
            spill=self.spill,
            host_mib=self.host_mib,
        )
        fam["tessera_metrics_sample_seconds"].add_metric([], time.monotonic() - started)
        return list(fam.values()), usage

    @staticmethod
    def _containers(
        fam: Mapping[str, GaugeMetricFamily | CounterMetricFamily],
        usages: Iterable[ContainerUsage],
        compute: Mapping[tuple[str, int], float],
    ) -> list[Used]:
        """Add the per-container families; what each container uses of each card."""
        used: list[Used] = []
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        for u in usages:
            o = u.owner
            unreadable = u.error not in ("", "absent")
            fam["tessera_container_region_unreadable"].add_metric(
                [o.namespace, o.pod, o.container], 1.0 if unreadable else 0.0
            )
            if u.snapshot is None:
                continue
            holding = u.snapshot.hold_mask if u.snapshot.hold_until_ns > now else 0
            for i, uuid in enumerate(o.uuids):
                values = [o.namespace, o.pod, o.container, uuid, str(i)]
                if o.priority is not None:
                    fam["tessera_container_gpu_launches_held"].add_metric(
                        values, float(holding >> i & 1)
                    )
                if (o.name, i) in compute:
                    fam["tessera_container_gpu_sm_utilization_percent"].add_metric(
                        values, compute[(o.name, i)]
                    )
                dev = u.snapshot.device(i)
                if dev is None:
                    continue
                fam["tessera_container_gpu_memory_used_bytes"].add_metric(
                    values, float(dev.used_bytes)
                )
                fam["tessera_container_gpu_memory_resident_bytes"].add_metric(
                    values, float(dev.resident_bytes)
                )
                fam["tessera_container_gpu_memory_spilled_bytes"].add_metric(
                    values, float(dev.spilled_bytes)
                )
                used.append(
                    Used(o, uuid, dev.used_bytes, compute.get((o.name, i)), dev.spilled_bytes)
                )
                fam["tessera_container_gpu_memory_limit_bytes"].add_metric(
                    values, float(dev.limit_bytes)
                )
                fam["tessera_container_gpu_compute_share_percent"].add_metric(
                    values, float(dev.core_limit_pct)
                )
                if u.snapshot.version >= 2 and o.priority is not None:
                    fam["tessera_container_gpu_launches"].add_metric(values, float(dev.launches))
        return used


class SampleCollector(Collector):
    """What a scrape sees: the sampler's latest families, nothing computed on the way."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def collect(self) -> Iterator[Metric]:
        yield from self.sampler.latest()
