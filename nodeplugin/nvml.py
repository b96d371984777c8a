"""GPU discovery and health through NVML (pynvml).

Health has two inputs: NVML events (critical XIDs, ``nvmlEventSetWait``) and probes (a cheap
query per card every ``TESSERA_HEALTH_PROBE_S``; a lost card fails it). A card marked
unhealthy by an XID comes back once no new critical XID arrived for
``TESSERA_HEALTH_RECOVERY_S`` and a probe passes; one that fails probes comes back when they
pass again. The monitor is a thread (NVML calls block); it reports changes through a callback.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from nodeplugin.cards import Card, Health

log = logging.getLogger(__name__)


class NvmlError(RuntimeError):
    pass


# The per-card figures :meth:`Nvml.figures` reads; "memory" gives used and total at once.
CARD_FIGURES = ("utilization", "memory", "temperature", "power")


@dataclass(frozen=True)
class ProcessSample:
    """One NVML per-process utilisation sample (the pid is the host's)."""

    pid: int
    timestamp_us: int
    sm_percent: int


def _numa_from_sysfs(bus_id: str) -> int | None:
    # NVML reports e.g. 00000000:07:00.0; sysfs names the device 0000:07:00.0.
    parts = bus_id.lower().split(":")
    if len(parts) == 3 and len(parts[0]) == 8:
        parts[0] = parts[0][4:]
    path = Path("/sys/bus/pci/devices") / ":".join(parts) / "numa_node"
    try:
        value = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


class Nvml:
    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlError(
                f"NVML cannot start ({exc}): is the NVIDIA driver installed and "
                "libnvidia-ml.so.1 on the library path?"
            ) from None
        self.handles: dict[str, Any] = {}

    def shutdown(self) -> None:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvmlShutdown: %s", exc)

    def discover(self) -> list[Card]:
        cards: list[Card] = []
        try:
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            raise NvmlError(f"nvmlDeviceGetCount failed: {exc}") from None
        for i in range(count):
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = str(pynvml.nvmlDeviceGetUUID(h))
                model = str(pynvml.nvmlDeviceGetName(h))
                memory_mib = int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // (1024 * 1024)
                minor = int(pynvml.nvmlDeviceGetMinorNumber(h))
            except pynvml.NVMLError as exc:
                log.error("card at NVML index %d cannot be read (%s); it is not advertised", i, exc)
                continue
            bus_id: str | None
            try:
                raw = pynvml.nvmlDeviceGetPciInfo(h).busId
                bus_id = (raw.decode() if isinstance(raw, bytes) else str(raw)) or None
            except pynvml.NVMLError:
                bus_id = None  # published without it (DRA's pciBusID attribute), not guessed
            numa: int | None
            try:
                numa = int(pynvml.nvmlDeviceGetNumaNodeId(h))
                if numa < 0:
                    numa = None
            except (pynvml.NVMLError, AttributeError):
                numa = _numa_from_sysfs(bus_id) if bus_id else None
            self.handles[uuid] = h
            cards.append(Card(uuid, i, model, memory_mib, minor, numa, bus_id))
        return cards

    def versions(self) -> tuple[str, str]:
        """The NVIDIA driver's version and the CUDA version it supports, as NVML gives them
        (``550.54.15``, ``12.4``); '' for one NVML cannot tell (DRA mode publishes only what
        it knows)."""
        try:
            raw = pynvml.nvmlSystemGetDriverVersion()
            driver = raw.decode() if isinstance(raw, bytes) else str(raw)
        except pynvml.NVMLError as exc:
            log.warning("nvmlSystemGetDriverVersion: %s", exc)
            driver = ""
        try:
            encoded = int(pynvml.nvmlSystemGetCudaDriverVersion_v2())
            cuda = f"{encoded // 1000}.{encoded % 1000 // 10}"  # 12040 -> 12.4
        except pynvml.NVMLError as exc:
            log.warning("nvmlSystemGetCudaDriverVersion_v2: %s", exc)
            cuda = ""
        return driver, cuda

    def probe(self, uuid: str) -> str:
        """'' when the card answers; else the reason."""
        h = self.handles.get(uuid)
        if h is None:
            return "no NVML handle"
        try:
            pynvml.nvmlDeviceGetMemoryInfo(h)
        except pynvml.NVMLError as exc:
            return f"NVML probe failed: {exc}"
        return ""

    def figures(self, uuid: str) -> tuple[dict[str, float], list[str]]:
        """The card's gauges as NVML reads them now, by figure name (utilization percent,
        memory used and total bytes, temperature degrees C, power watts), and the names of
        those NVML could not read: a figure that fails is left out, never made up."""
        h = self.handles.get(uuid)
        if h is None:
            return {}, list(CARD_FIGURES)
        out: dict[str, float] = {}
        failed: list[str] = []

        def read(name: str, fn: Callable[[], float]) -> None:
            try:
                out[name] = float(fn())
            except pynvml.NVMLError as exc:
                failed.append(name)
                log.debug("card %s: %s cannot be read (%s)", uuid, name, exc)

        read("utilization", lambda: pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        except pynvml.NVMLError as exc:
            failed.append("memory")
            log.debug("card %s: memory cannot be read (%s)", uuid, exc)
        else:
            out["memory_used"] = float(mem.used)
            out["memory_total"] = float(mem.total)
        read("temperature", lambda: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
        # NVML answers in milliwatts.
        read("power", lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0)
        return out, failed

    def process_utilization(self, uuid: str, last_seen_us: int) -> list[ProcessSample]:
        """Per-process SM utilisation samples newer than ``last_seen_us`` (NVML's CPU timestamp,
        microseconds). No sample since then is an empty list (NVML's NOT_FOUND: nothing ran);
        any other failure raises NvmlError."""
        h = self.handles.get(uuid)
        if h is None:
            raise NvmlError(f"card {uuid} has no NVML handle")
        try:
            raw = pynvml.nvmlDeviceGetProcessUtilization(h, last_seen_us)
        except pynvml.NVMLError as exc:
            # pynvml raises on every answer to its sizing call but INSUFFICIENT_SIZE, so a
            # driver that says SUCCESS there (no process at all) arrives here as code 0.
            if exc.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_SUCCESS):
                return []
            raise NvmlError(f"nvmlDeviceGetProcessUtilization on {uuid}: {exc}") from None
        return [ProcessSample(int(s.pid), int(s.timeStamp), int(s.smUtil)) for s in raw]


class HealthMonitor(threading.Thread):
    """Watches XID events and probes; calls ``on_change(uuid, Health)`` when a card flips."""

    def __init__(
        self,
        nvml: Nvml,
        cards: Collection[Card],
        on_change: Callable[[str, Health], None],
        *,
        probe_s: float,
        recovery_s: float,
        ignored_xids: Collection[int],
        wait_ms: int = 200,
    ) -> None:
        super().__init__(name="nvml-health", daemon=True)
        self.nvml = nvml
        self.uuids = [c.uuid for c in cards]
        self.on_change = on_change
        self.probe_s = probe_s
        self.recovery_s = recovery_s
        self.ignored = frozenset(ignored_xids)
        self.wait_ms = wait_ms
        self.health: dict[str, Health] = {u: Health(True) for u in self.uuids}
        self.quiet_until: dict[str, float] = {}
        # XIDs per card, ignored ones too (metrics), for the cards whose XID events NVML
        # delivers: a card without them has no count rather than a zero. Only this thread
        # writes it.
        self.xids: dict[str, int] = {}
        self._stop_flag = threading.Event()

    def stop(self) -> None:
        self._stop_flag.set()

    def _set(self, uuid: str, health: Health) -> None:
        if self.health.get(uuid) != health:
            self.health[uuid] = health
            if health.healthy:
                log.warning("card %s is healthy again", uuid)
            else:
                log.error("card %s is unhealthy: %s", uuid, health.reason)
            self.on_change(uuid, health)

    def _event_set(self) -> Any:
        try:
            es = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("NVML events unavailable (%s); health comes from probes only", exc)
            return None
        for uuid in self.uuids:
            try:
                pynvml.nvmlDeviceRegisterEvents(
                    self.nvml.handles[uuid], pynvml.nvmlEventTypeXidCriticalError, es
                )
                self.xids.setdefault(uuid, 0)
            except pynvml.NVMLError as exc:
                log.warning("card %s: XID events unavailable (%s); probes only", uuid, exc)
        return es

    def handle_xid(self, uuid: str, xid: int) -> None:
        self.xids[uuid] = self.xids.get(uuid, 0) + 1
        if xid in self.ignored:
            log.info("card %s: XID %d (application error, ignored)", uuid, xid)
            return
        self.quiet_until[uuid] = time.monotonic() + self.recovery_s
        self._set(uuid, Health(False, f"XID {xid}"))

    def probe_all(self) -> None:
        now = time.monotonic()
        for uuid in self.uuids:
            reason = self.nvml.probe(uuid)
            if reason:
                self._set(uuid, Health(False, reason))
            elif not self.health[uuid].healthy and now >= self.quiet_until.get(uuid, 0.0):
                self._set(uuid, Health(True))

    def run(self) -> None:
        es = self._event_set()
        next_probe = 0.0
        try:
            while not self._stop_flag.is_set():
                now = time.monotonic()
                if now >= next_probe:
                    self.probe_all()
                    next_probe = now + self.probe_s
                if es is None:
                    self._stop_flag.wait(min(self.wait_ms / 1000, self.probe_s))
                    continue
                try:
                    data = pynvml.nvmlEventSetWait(es, self.wait_ms)
                except pynvml.NVMLError_Timeout:
                    continue
                except pynvml.NVMLError as exc:
                    log.warning("nvmlEventSetWait: %s", exc)
                    self._stop_flag.wait(self.wait_ms / 1000)
                    continue
                try:
                    uuid = str(pynvml.nvmlDeviceGetUUID(data.device))
                except pynvml.NVMLError as exc:
                    log.error("XID %d on a card NVML cannot name (%s)", data.eventData, exc)
                    continue
                if uuid in self.health:
                    self.handle_xid(uuid, int(data.eventData))
        finally:
            if es is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlEventSetFree(es)
