"""The node plugin process: discover, serve, confirm, register, watch, report, stop on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any, cast

import grpc
import grpc.aio
from prometheus_client import CollectorRegistry, start_http_server

from nodeplugin import __version__, edits, ids
from nodeplugin import cards as cardmod
from nodeplugin.allocation import MIG, MPS
from nodeplugin.cards import Card, Health
from nodeplugin.config import DRA, Settings
from nodeplugin.controlplane import ControlPlane, ControlPlaneError
from nodeplugin.dra_node import DraNode
from nodeplugin.dra_slices import NodeVersions
from nodeplugin.http import HttpUnavailable
from nodeplugin.kubeapi import KubeApi
from nodeplugin.metrics import SampleCollector, Sampler
from nodeplugin.mig import Mig, MigError, MigStatus
from nodeplugin.mps import MpsDaemon
from nodeplugin.nvml import HealthMonitor, Nvml
from nodeplugin.pb import dp
from nodeplugin.podresources import PodResources, PodResourcesError
from nodeplugin.priority import PriorityMonitor
from nodeplugin.registry import Registry
from nodeplugin.rpc import (
    API_VERSION,
    DevicePluginClient,
    RegistrationClient,
    device_plugin_handler,
    unix_target,
)
from nodeplugin.servicer import Servicer
from nodeplugin.sockets import inode, remove_dead_sockets
from nodeplugin.sources import (
    AllocationSource,
    AnnotationSource,
    ControlPlaneSource,
    FallbackSource,
)
from nodeplugin.store import NameStore
from nodeplugin.usage import UsageReader
from nodeplugin.writer import Writer

log = logging.getLogger("nodeplugin")
# A part of the inventory report the control plane refused is offered again after this long.
REFUSED_PART_RETRY_S = 600.0
# The kubelet opens ListAndWatch within milliseconds of a registration it accepted; with no
# stream of ours this long after registering, it has dropped us and is asked again.
STREAM_WAIT_S = 3.0
# How long the first inventory report waits for the kubelet to take the cards, so that a
# plugin that starts does not report them unavailable for the blink before it is registered.
FIRST_REPORT_WAIT_S = 10.0
# The report a stopping plugin sends to say its cards take no new pods is cut short after this.
LAST_REPORT_S = 2.0
UNREGISTERED = "the node plugin is not registered with the kubelet (starting or restarting)"
STOPPING = "the node plugin is stopping"


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns)


class Plugin:
    def __init__(self, settings: Settings, nvml: Nvml | None = None) -> None:
        self.s = settings
        self.nvml = nvml or Nvml()
        self.cards: list[Card] = self.nvml.discover()
        self.stopping = asyncio.Event()
        # SIGTERM: the control plane is told first, then the kubelet's stream ends (stopping).
        self.terminating = asyncio.Event()
        self.registry = Registry(self.cards, settings.slots)
        # A card's health is its NVML health, and then what its mode needs (MIG on, the MPS
        # daemon running); the kubelet and the control plane see the first thing wrong.
        self.nvml_health: dict[str, Health] = {}
        self.modes: dict[str, str] = {}
        self.mig = Mig(self.nvml.handles, settings.state_dir)
        self.mig_status: dict[str, MigStatus] = {}
        self.mig_error: dict[str, str] = {}
        # inventory report key ("mig", "usage") -> monotonic time until which it is left out
        self._refused_until: dict[str, float] = {}
        self.mps = MpsDaemon(settings.mps_control, settings.state_dir, settings.mps_poll_s)
        self.cp = ControlPlane(
            settings.controlplane_url,
            settings.token_file,
            settings.ca_file,
            settings.http_timeout_s,
        )
        self.podres = PodResources(settings.pod_resources_socket, settings.resource_name)
        source: AllocationSource
        if settings.allocation_source == "annotation" or settings.allocation_fallback:
            kube = KubeApi(
                settings.kube_api_url,
                settings.kube_token_file,
                settings.kube_ca_file,
                settings.http_timeout_s,
            )
            signed = AnnotationSource(kube, settings.allocation_key, settings.node_name)
        if settings.allocation_source == "annotation":
            source = signed
        elif settings.allocation_fallback:
            source = FallbackSource(
                ControlPlaneSource(self.cp, settings.node_name),
                signed,
                settings.controlplane_wait_s,
            )
        else:
            source = ControlPlaneSource(self.cp, settings.node_name)
        layout = edits.Layout(
            dev_root=settings.dev_root,
            region_dir=settings.region_dir,
            region_container_dir=settings.region_container_dir,
            state_dir=settings.state_dir,
            config_container_dir=settings.config_container_dir,
            shim_library=settings.shim_library,
            shim_container_path=settings.shim_container_path,
            preload=settings.preload,
            container_log_level=settings.container_log_level,
            mps_pipe_dir=self.mps.pipe_dir,
            mps_container_dir=settings.mps_container_dir,
        )
        control = [c for c in edits.CONTROL_DEVICES if (settings.dev_root / c).exists()]
        self.writer = Writer(
            settings.device_mode, settings.cdi_dir, settings.cdi_kind, layout, control
        )
        self.writer.prepare()
        self.names = NameStore(settings.state_dir)
        self.servicer = Servicer(
            settings,
            self.registry,
            self.names,
            self.writer,
            self.podres,
            source,
            self.cp,
            self.stopping,
            mig=self.mig,
        )
        self.server: grpc.aio.Server | None = None
        self.monitor: HealthMonitor | None = None
        self.priority = PriorityMonitor(
            settings.state_dir,
            settings.region_dir,
            settings.priority_poll_s,
            settings.priority_busy_s,
        )
        self._report_now = asyncio.Event()
        self.sampler: Sampler | None = None
        self.registrations = 0
        self._socket_inode: tuple[int, int] | None = None  # the socket file this process made
        self._private: Path | None = None  # that socket's own name, which the kubelet dials
        # DRA mode (docs/dra.md): the kubelet's DRA plugin in place of the device plugin.
        self.dra: DraNode | None = None
        if settings.plugin_mode == DRA:
            self.dra = DraNode(
                settings,
                KubeApi(
                    settings.kube_api_url,
                    settings.kube_token_file,
                    settings.kube_ca_file,
                    settings.http_timeout_s,
                ),
                self.writer,
                self.cards,
                lambda: (self.modes, self.registry.health),
                self.registry.changed,
                NodeVersions(*self.nvml.versions()),
                self.mig,
            )

    # -- gRPC server -----------------------------------------------------------------------

    async def start_server(self) -> None:
        """Serve on a socket of this process's own, registered with the kubelet under that
        name, and give it the plugin's well-known name too (for probes and operators) by an
        atomic rename of a hard link.

        The kubelet's device manager keys a plugin's connection by the socket path it was
        registered with, and drops every connection at a path when one of them ends. Were a
        successor (the DaemonSet's next pod, started while this one terminates) registered at
        the same path, this process's stream ending would take the successor's along, leaving
        the kubelet with the cards unhealthy and nobody to tell it otherwise. Under names of
        their own the kubelet hands the resource from one to the other: the last one to go
        marks the cards unhealthy, not the one that goes while another serves. gRPC removes its
        socket's path when it stops, and a successor's public name is left alone."""
        path = self.s.plugin_socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        # Private sockets (`.<name>.<hex>`) left by a plugin that was killed.
        remove_dead_sockets(path.parent, f".{path.name}.*")
        # Unique per start: in a pod every plugin is PID 1, so a PID would not tell two apart.
        private = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((device_plugin_handler(self.servicer),))
        server.add_insecure_port(unix_target(str(private)))
        await server.start()
        self.server = server
        link = path.with_name(private.name + ".link")
        os.link(private, link)
        os.replace(link, path)
        self._socket_inode = inode(path)
        self._private = private
        await self._confirm_serving()
        log.info("serving the device plugin API on %s", path)

    async def _confirm_serving(self) -> None:
        """Dial our own socket and call GetDevicePluginOptions, as the kubelet will."""
        async with grpc.aio.insecure_channel(unix_target(str(self.s.plugin_socket_path))) as ch:
            opts = await DevicePluginClient(ch).GetDevicePluginOptions(dp.Empty(), timeout=5)
            if not opts.pre_start_required:
                raise RuntimeError("self-check: the served options are wrong")

    async def stop_server(self, grace: float) -> None:
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        # Only our own socket: when the DaemonSet replaces this pod, the new plugin may already
        # serve on the same path, and removing its socket would cut it off from the kubelet.
        path = self.s.plugin_socket_path
        if self._socket_inode is not None and inode(path) == self._socket_inode:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._socket_inode = None
        self._private = None

    def _successor_serves(self) -> bool:
        """The plugin's well-known name is another process's socket: a successor took over."""
        current = inode(self.s.plugin_socket_path)
        return current is not None and current != self._socket_inode

    async def register(self) -> None:
        assert self._private is not None, "serve before registering: the kubelet dials back"
        async with grpc.aio.insecure_channel(unix_target(str(self.s.kubelet_socket_path))) as ch:
            await RegistrationClient(ch).Register(
                dp.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self._private.name,
                    resource_name=self.s.resource_name,
                    options=dp.DevicePluginOptions(
                        pre_start_required=True, get_preferred_allocation_available=True
                    ),
                ),
                timeout=15,
            )
        self.registrations += 1
        log.info(
            "registered %s with the kubelet as %s (%d card(s) x %d slots)",
            self.s.resource_name,
            self._private.name,
            len(self.cards),
            self.s.slots,
        )

    async def watch_kubelet(self) -> None:
        """Register whenever kubelet.sock is (re-)created, and again when the kubelet holds no
        ListAndWatch stream of ours a while after registering (it dropped the connection);
        restart our server if the kubelet removed our socket on its restart."""
        registered_for: tuple[int, int] | None = None
        registered_at = 0.0
        delay = self.s.kubelet_poll_s
        while not self.stopping.is_set():
            kubelet = _stamp(self.s.kubelet_socket_path)
            if self.server is None or self._private is None or _stamp(self._private) is None:
                log.warning("our socket %s is gone; serving again", self.s.plugin_socket_path)
                await self.stop_server(0)
                await self.start_server()
                registered_for = None
            if (
                registered_for is not None
                and self.registry.streams == 0
                and time.monotonic() - registered_at > STREAM_WAIT_S
            ):
                log.warning(
                    "the kubelet holds no ListAndWatch stream of ours %.0fs after registering; "
                    "registering again",
                    STREAM_WAIT_S,
                )
                registered_for = None
            if kubelet is not None and kubelet != registered_for:
                try:
                    await self.register()
                    registered_for = kubelet
                    registered_at = time.monotonic()
                    delay = self.s.kubelet_poll_s
                except grpc.aio.AioRpcError as exc:
                    log.warning(
                        "registration failed (%s: %s); retrying", exc.code().name, exc.details()
                    )
                    delay = min(max(delay * 2, 0.1), 5.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)

    # -- health and inventory --------------------------------------------------------------

    def _on_health(self, uuid: str, health: Health) -> None:
        self.nvml_health[uuid] = health
        self._refresh_health(uuid)

    def _mode_health(self, uuid: str) -> Health:
        mode = self.modes.get(uuid)
        if mode == MIG:
            if uuid in self.mig_error:
                return Health(False, self.mig_error[uuid])
            st = self.mig_status.get(uuid)
            if st is None or st.enabled:
                return Health(True)
            if st.pending:
                return Health(False, "MIG mode waits for a GPU reset (nvidia-smi -r, or a reboot)")
            return Health(False, "MIG mode is not on")
        if mode == MPS and not self.mps.healthy:
            return Health(False, self.mps.reason)
        return Health(True)

    def _refresh_health(self, uuid: str) -> None:
        nvml = self.nvml_health.get(uuid, Health(True))
        if self.registry.set_health(uuid, nvml if not nvml.healthy else self._mode_health(uuid)):
            self._report_now.set()

    def _refresh_all(self) -> None:
        for c in self.cards:
            self._refresh_health(c.uuid)

    # -- card modes ------------------------------------------------------------------------

    def _mig_report(self) -> dict[str, dict[str, object]]:
        """The inventory's ``mig`` object of each MIG-capable card (NVML calls: a thread)."""
        out: dict[str, dict[str, object]] = {}
        for c in self.cards:
            st = self.mig.status(c.uuid)
            if not st.capable:
                continue
            try:
                # A GPU instance without a compute instance has no MIG device (no UUID) to show.
                instances = [i.report() for i in self.mig.instances(c.uuid) if i.uuid]
            except MigError as exc:
                log.warning("%s", exc)
                instances = []
            out[c.uuid] = {"capable": True, "enabled": st.enabled, "instances": instances}
        return out

    def _apply_mig_modes(self) -> None:
        """MIG on for every card whose mode is mig (NVML calls: a thread)."""
        for uuid, mode in self.modes.items():
            if mode != MIG:
                continue
            try:
                self.mig_status[uuid] = self.mig.enable(uuid)
                self.mig_error.pop(uuid, None)
            except MigError as exc:
                self.mig_error[uuid] = str(exc)
                log.error("%s", exc)

    async def apply_modes(self, modes: dict[str, str]) -> None:
        changed = modes != self.modes
        if changed:
            log.info("card modes: %s", modes or "all shared")
        self.modes = modes
        before = dict(self.mig_status)
        await asyncio.to_thread(self._apply_mig_modes)
        if changed or before != self.mig_status:
            self._refresh_all()
            self._report_now.set()
            if self.dra is not None:
                self.dra.changed()

    async def mps_loop(self) -> None:
        """One MPS control daemon for the node's mps cards, level-based every poll."""
        while not self.stopping.is_set():
            cards = [c.uuid for c in self.cards if self.modes.get(c.uuid) == MPS]
            try:
                await self.mps.tick(cards, self._refresh_all)
            except OSError as exc:
                log.error("MPS control daemon: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.s.mps_poll_s)

    async def mig_reconcile(self) -> None:
        """After a (re)start: the MIG instances this plugin created whose devices no container
        holds any more are destroyed; those still held are adopted; instances someone else made
        are reported and left alone. Nothing is destroyed before the kubelet has answered."""
        while not self.stopping.is_set():
            try:
                listed = await self.podres.list(time.monotonic() + 5)
                break
            except PodResourcesError as exc:
                log.warning("MIG reconcile waits for the kubelet: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 1.0)
        else:
            return
        held: set[str] = set()
        for holding in listed:
            held |= holding.device_ids
        owned = self.mig.owned()
        for o in owned:
            if set(self.names.ids(o.digest)) & held:
                log.info(
                    "MIG %s at %d+%d on %s adopted (still held by %s)",
                    o.profile,
                    o.start,
                    o.size,
                    o.card,
                    o.container,
                )
                continue
            try:
                await asyncio.to_thread(self.mig.release, o)
            except MigError as exc:
                log.error("orphaned MIG instance not destroyed: %s", exc)
        mine = {(o.card, o.start, o.size) for o in owned}
        for c in self.cards:
            try:
                found = await asyncio.to_thread(self.mig.instances, c.uuid)
            except MigError as exc:
                log.warning("%s", exc)
                continue
            for i in found:
                if (i.card, i.start, i.size) not in mine:
                    log.warning(
                        "card %s: MIG %s at %d+%d (GPU instance %d) was not created by Tessera; "
                        "left alone",
                        i.card,
                        i.profile,
                        i.start,
                        i.size,
                        i.gi,
                    )

    async def release_mig(self, digest: str) -> None:
        """Destroy the MIG instances created for the allocation ``digest`` (its binding ended)."""
        for o in self.mig.owned():
            if o.digest != digest:
                continue
            try:
                await asyncio.to_thread(self.mig.release, o)
            except MigError as exc:
                log.error("MIG instance of an ended binding not destroyed (retried): %s", exc)

    def start_monitor(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.s.health_checks:
            return

        def report(uuid: str, health: Health) -> None:
            loop.call_soon_threadsafe(self._on_health, uuid, health)

        self.monitor = HealthMonitor(
            self.nvml,
            self.cards,
            report,
            probe_s=self.s.health_probe_s,
            recovery_s=self.s.health_recovery_s,
            ignored_xids=self.s.ignored_xids,
        )
        self.monitor.start()

    def _offered(self, part: str) -> bool:
        """Whether the inventory report carries `part` now (not refused in the last while)."""
        return time.monotonic() >= self._refused_until.get(part, 0.0)

    async def _put_report(self, report: dict[str, object]) -> dict[str, Any]:
        """Send the inventory report. The node must keep its heartbeat, so a part the control
        plane refuses by name (one older than card modes refuses `mig`, one older than usage
        reports `usage`, or a usage figure it finds wrong) is left out, offered again later."""
        cards = cast(list[dict[str, object]], report["cards"])
        while True:
            try:
                return await self.cp.put_inventory(self.s.node_name, report)
            except ControlPlaneError as exc:
                if exc.status != 400:
                    raise
                if "usage" in report and "usage" in str(exc):
                    part, what = "usage", "the containers' usage"
                    del report["usage"]
                elif "mig" in str(exc) and any("mig" in c for c in cards):
                    part, what = "mig", "the cards' MIG state"
                    for card in cards:
                        card.pop("mig", None)
                elif any(k in report and k in str(exc) for k in cardmod.VIRTUAL_MEMORY_KEYS):
                    # Without them the control plane takes the node as one that spills nothing.
                    part, what = "memory", "the node's oversubscription and spill reserve"
                    for k in cardmod.VIRTUAL_MEMORY_KEYS:
                        report.pop(k, None)
                else:
                    raise
                self._refused_until[part] = time.monotonic() + REFUSED_PART_RETRY_S
                log.warning(
                    "the control plane does not take %s (%s); reporting without it for %.0fs",
                    what,
                    exc,
                    REFUSED_PART_RETRY_S,
                )

    def _memory_fields(self) -> dict[str, object]:
        """The report's virtual device memory keys, unless the control plane refused them."""
        if not self._offered("memory"):
            return {}
        s = self.s
        return cardmod.virtual_memory_fields(
            s.memory_oversubscription, s.spill_reserve_mib, s.host_memory_mib
        )

    def _reported_health(self) -> dict[str, Health]:
        """The cards' health as the control plane must see it: a card the kubelet cannot hand
        out now (no stream of ours held, or this plugin stopping) takes no new pods, so the
        scheduler does not bind one that the kubelet would refuse for good at admission."""
        health = dict(self.registry.health)
        unregistered = self.dra is None and self.registry.streams == 0
        if unregistered or self.terminating.is_set():
            why = STOPPING if self.terminating.is_set() else UNREGISTERED
            for uuid, h in health.items():
                if h.healthy:
                    health[uuid] = Health(False, why)
        return health

    async def _kubelet_took_the_cards(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while (
                    self.dra is None
                    and self.registry.streams == 0
                    and not self.terminating.is_set()
                ):
                    await self.registry.streams_changed().wait()

    async def _watch_streams(self) -> None:
        """Report at once when the kubelet takes the cards or lets them go."""
        while not self.stopping.is_set():
            await self.registry.streams_changed().wait()
            self._report_now.set()

    async def last_report(self) -> bool:
        """Tell the control plane that this plugin's cards take no new pods, unless a successor
        already serves them (its reports are the true ones then). Sent before the kubelet's
        stream ends: from then until a successor registers, the kubelet refuses the cards at
        admission, and a pod bound in that gap would fail for good."""
        if self.dra.successor_serves() if self.dra is not None else self._successor_serves():
            return False
        report = cardmod.inventory_report(
            __version__, self.cards, self._reported_health(), memory=self._memory_fields()
        )
        try:
            async with asyncio.timeout(LAST_REPORT_S):
                await self._put_report(report)
        except (TimeoutError, HttpUnavailable, ControlPlaneError) as exc:
            log.warning("the last inventory report was not taken (%s)", exc)
        return True

    async def report_loop(self) -> None:
        delay = 0.0
        failures = 0
        await self._kubelet_took_the_cards(FIRST_REPORT_WAIT_S)
        # Until SIGTERM: then the last report (run) is the plugin's final word, and a heartbeat
        # after it could overwrite what a successor reported meanwhile.
        while not self.terminating.is_set():
            self._report_now.clear()
            mig = await asyncio.to_thread(self._mig_report) if self._offered("mig") else {}
            report = cardmod.inventory_report(
                __version__, self.cards, self._reported_health(), mig, self._memory_fields()
            )
            usage = self.sampler.latest_usage() if self.sampler is not None else None
            if usage is not None and self._offered("usage"):
                report["usage"] = usage
            try:
                answer = await self._put_report(report)
                modes = cardmod.modes_from_answer(answer, self.registry.cards.keys())
                if modes is not None:
                    await self.apply_modes(modes)
                if self.dra is not None:
                    self.dra.modes_known()
                await self.servicer.retry_pending_posts()
                if failures:
                    log.warning("inventory report accepted again after %d failure(s)", failures)
                failures = 0
                delay = self.s.heartbeat_s
            except (HttpUnavailable, ControlPlaneError) as exc:
                failures += 1
                delay = min(self.s.heartbeat_s, 0.5 * 2 ** min(failures, 6))
                log.error("inventory report failed (%s); next try in %.1fs", exc, delay)
            stop = asyncio.ensure_future(self.terminating.wait())
            now = asyncio.ensure_future(self._report_now.wait())
            await asyncio.wait({stop, now}, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            now.cancel()

    async def gc_loop(self) -> None:
        """Drop names, specs and artifacts whose device IDs no container holds any more."""
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.s.gc_interval_s)
            if self.stopping.is_set():
                return
            try:
                listed = await self.podres.list(time.monotonic() + 5)
            except PodResourcesError as exc:
                log.warning("gc skipped: %s", exc)
                continue
            held: set[str] = set()
            for c in listed:
                held |= c.device_ids
            cutoff = time.time() - self.s.gc_interval_s
            for digest in self.names.digests():
                record_ids = self.names.ids(digest)
                try:
                    issued = self.names.names(digest)
                except Exception:
                    issued = []
                if set(record_ids) & held or any(n.issued_unix > cutoff for n in issued):
                    continue
                for n in issued:
                    self.writer.remove(n.name)
                await self.release_mig(digest)
                if any(o.digest == digest for o in self.mig.owned()):
                    continue  # an instance is still busy: keep the record, try again next pass
                self.names.remove(digest)
                log.info("gc: released %s", ",".join(record_ids))

    async def priority_loop(self) -> None:
        """Task priority: who holds their launches on which card, level-based every poll (a
        restarted plugin puts right whatever its predecessor left)."""
        while not self.stopping.is_set():
            self.priority.tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.s.priority_poll_s)

    def start_metrics(self) -> None:
        """The sampler, always: its usage rides on the inventory report; the /metrics endpoint
        only with a metrics port."""
        monitor = self.monitor
        self.sampler = Sampler(
            self.nvml,
            self.cards,
            node=self.s.node_name,
            usage=UsageReader(self.s.state_dir, self.s.region_dir),
            proc_root=self.s.proc_root,
            interval_s=self.s.metrics_interval_s,
            # Read from the sampler's thread: each is a copy or a plain dict read, which the
            # interpreter does whole while the event loop or the health thread replaces entries.
            modes=lambda: dict(self.modes),
            health=lambda: dict(self.registry.health),
            xids=lambda: dict(monitor.xids) if monitor is not None else {},
            spill=bool(self._memory_fields()),
            host_mib=self.s.host_memory_mib,
        )
        self.sampler.start()
        if not self.s.metrics_port:
            log.info("usage sampled every %.3gs; no metrics port", self.s.metrics_interval_s)
            return
        registry = CollectorRegistry()
        registry.register(SampleCollector(self.sampler))
        start_http_server(self.s.metrics_port, registry=registry)
        log.info(
            "metrics on :%d/metrics, sampled every %.3gs",
            self.s.metrics_port,
            self.s.metrics_interval_s,
        )

    # -- lifecycle -------------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.terminating.set)
        log.info(
            "tessera node plugin %s on node %s: %d card(s) %s",
            __version__,
            self.s.node_name,
            len(self.cards),
            ", ".join(f"{c.index}:{c.uuid}" for c in self.cards),
        )
        for card in self.cards:
            ids.make_id(card.uuid, self.s.slots - 1)  # fail at start on an over-long ID
        self.start_monitor(loop)
        self.start_metrics()
        if self.dra is not None:
            await self.dra.start()
        else:
            await self.start_server()
        reports = asyncio.create_task(self.report_loop(), name="report")
        tasks = [
            reports,
            asyncio.create_task(self.priority_loop(), name="priority"),
            asyncio.create_task(self.mps_loop(), name="mps"),
        ]
        if self.dra is not None:
            tasks.append(asyncio.create_task(self.dra.run(self.stopping), name="dra"))
        else:
            tasks += [
                asyncio.create_task(self.watch_kubelet(), name="watch-kubelet"),
                asyncio.create_task(self._watch_streams(), name="watch-streams"),
                asyncio.create_task(self.gc_loop(), name="gc"),
                asyncio.create_task(self.mig_reconcile(), name="mig-reconcile"),
            ]
        await self.terminating.wait()
        log.info("stopping")
        # The heartbeat loop ends at its next turn. A report in flight (its request runs in a
        # thread, which cancelling would not stop) is let finish first, so that it cannot land
        # after the last report and say the cards are free again.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reports, self.s.http_timeout_s + 1)
        await asyncio.gather(reports, return_exceptions=True)
        if await self.last_report():
            # A pod bound just before the report reached the ledger is admitted by the kubelet
            # a moment later: keep the devices healthy for it until then.
            await asyncio.sleep(self.s.stop_drain_s)
        self.stopping.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.priority.release_all()
        if self.dra is not None:
            await self.dra.stop(2.0)
        else:
            await self.stop_server(2.0)
        await self.podres.close()
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor.join(timeout=2)
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler.join(timeout=5)  # no NVML call may be in flight at nvmlShutdown
        self.nvml.shutdown()
        log.info("stopped")


def configure_logging() -> None:
    level = os.environ.get("TESSERA_LOG_LEVEL", "info").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
