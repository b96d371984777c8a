"""The kubelet-facing DevicePlugin service: translates protobuf to the pure helpers and back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
import grpc.aio

from nodeplugin import edits, ids, resolve
from nodeplugin.allocation import MIG, Allocation, AllocationError
from nodeplugin.config import Settings
from nodeplugin.controlplane import ControlPlane, ControlPlaneError
from nodeplugin.http import HttpUnavailable
from nodeplugin.mig import Mig, MigError, MigInstance, Owned, cap_minors
from nodeplugin.pb import dp
from nodeplugin.podresources import PodResources, PodResourcesError
from nodeplugin.registry import Registry
from nodeplugin.sources import AllocationSource, NoAllocation, SourceUnavailable
from nodeplugin.store import NameStore, StoreError
from nodeplugin.writer import Writer

log = logging.getLogger(__name__)
Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
# Short: a pod re-created under the same name (StatefulSet) must not get the old pod's hint.
PREFERRED_CACHE_S = 2.0


class Servicer:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        names: NameStore,
        writer: Writer,
        podres: PodResources,
        source: AllocationSource,
        controlplane: ControlPlane,
        stopping: asyncio.Event,
        *,
        mig: Mig | None = None,
    ) -> None:
        self.s = settings
        self.registry = registry
        self.names = names
        self.writer = writer
        self.podres = podres
        self.source = source
        self.cp = controlplane
        self.stopping = stopping
        self.mig = mig
        self._alloc_cache: dict[tuple[str, str], tuple[float, Allocation | None]] = {}
        self._pending_posts: dict[tuple[str, str], list[str]] = {}
        self._lock = asyncio.Lock()

    # -- plain RPCs ------------------------------------------------------------------------

    async def GetDevicePluginOptions(
        self, request: dp.Empty, context: Ctx
    ) -> dp.DevicePluginOptions:
        return dp.DevicePluginOptions(
            pre_start_required=True, get_preferred_allocation_available=True
        )

    async def ListAndWatch(
        self, request: dp.Empty, context: Ctx
    ) -> AsyncIterator[dp.ListAndWatchResponse]:
        stop = asyncio.ensure_future(self.stopping.wait())
        self.registry.stream_opened()
        try:
            while not self.stopping.is_set():
                changed = self.registry.changed()
                yield self.registry.snapshot()
                waiter = asyncio.ensure_future(changed.wait())
                await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
        finally:
            stop.cancel()
            self.registry.stream_closed()

    def _parse(self, values: Any) -> list[ids.DeviceId]:
        return ids.parse_ids(list(values), self.registry.cards.keys(), self.registry.slots)

    async def Allocate(self, request: dp.AllocateRequest, context: Ctx) -> dp.AllocateResponse:
        responses = []
        for creq in request.container_requests:
            try:
                device_ids = self._parse(creq.devices_ids)
            except ids.DeviceIdError as exc:
                log.error("Allocate refused: %s", exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            sick = sorted({d.uuid for d in device_ids if not self.registry.health[d.uuid].healthy})
            if sick:
                msg = f"Allocate refused: card(s) {', '.join(sick)} are unhealthy"
                log.error(msg)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, msg)
            canonical = ids.canonical(device_ids)
            digest = ids.ids_digest(canonical)
            name = ids.allocation_name(digest, secrets.randbits(32))
            try:
                self.names.add(digest, canonical, name)
            except OSError as exc:
                msg = f"Allocate: cannot record the allocation name in {self.s.state_dir}: {exc}"
                log.error(msg)
                await context.abort(grpc.StatusCode.INTERNAL, msg)
            responses.append(self._allocate_response(name, device_ids))
            log.info("Allocate %s -> %s", ",".join(canonical), name)
        return dp.AllocateResponse(container_responses=responses)

    def _allocate_response(
        self, name: str, device_ids: list[ids.DeviceId]
    ) -> dp.ContainerAllocateResponse:
        cards = [self.registry.cards[u] for u in sorted({d.uuid for d in device_ids})]
        if self.s.device_mode == "paths":
            r = edits.paths_allocate(name, cards, self.writer.layout, self.writer.control_devices)
            return dp.ContainerAllocateResponse(
                envs=r.envs,
                mounts=[
                    dp.Mount(container_path=c, host_path=h, read_only=ro) for c, h, ro in r.mounts
                ],
                devices=[
                    dp.DeviceSpec(container_path=c, host_path=h, permissions=p)
                    for c, h, p in r.devices
                ],
            )
        qualified = f"{self.s.cdi_kind}={name}"
        names = [qualified]
        if self.s.nvidia_cdi_kind:
            names += [f"{self.s.nvidia_cdi_kind}={c.uuid}" for c in edits.paths_order(cards)]
        if self.s.cdi_annotation:
            return dp.ContainerAllocateResponse(
                annotations={f"cdi.k8s.io/tessera_{name}": ",".join(names)}
            )
        return dp.ContainerAllocateResponse(cdi_devices=[dp.CDIDevice(name=n) for n in names])

    # -- GetPreferredAllocation ------------------------------------------------------------

    async def _cached_allocation(
        self, namespace: str, pod: str, deadline: float
    ) -> Allocation | None:
        key = (namespace, pod)
        now = time.monotonic()
        hit = self._alloc_cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            alloc: Allocation | None = await self.source.fetch(namespace, pod, deadline)
        except NoAllocation:
            alloc = None
        except (AllocationError, SourceUnavailable) as exc:
            log.debug("preferred allocation: %s/%s: %s", namespace, pod, exc)
            return None
        self._alloc_cache[key] = (now + PREFERRED_CACHE_S, alloc)
        if len(self._alloc_cache) > 4096:
            self._alloc_cache = {k: v for k, v in self._alloc_cache.items() if v[0] > now}
        return alloc

    async def _wanted_cards(self, size: int) -> frozenset[str] | None:
        deadline = time.monotonic() + 2.0
        try:
            listed = await self.podres.list(deadline)
        except PodResourcesError as exc:
            log.warning("preferred allocation without a hint: %s", exc)
            return None
        pods = sorted({(c.namespace, c.pod) for c in listed})
        # Forget pods the kubelet no longer lists: a new pod with the same name is another pod.
        self._alloc_cache = {k: v for k, v in self._alloc_cache.items() if k in set(pods)}
        allocs = await asyncio.gather(*(self._cached_allocation(ns, p, deadline) for ns, p in pods))
        wanted: list[frozenset[str]] = []
        for alloc in allocs:
            if alloc is not None:
                wanted += resolve.pending_card_sets(alloc, listed, size)
        distinct = set(wanted)
        if len(distinct) > 1:
            log.info(
                "preferred allocation: %d pods wait for %d slice(s); hinting the first",
                len(distinct),
                size,
            )
        return wanted[0] if wanted else None

    async def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: Ctx
    ) -> dp.PreferredAllocationResponse:
        out = []
        for creq in request.container_requests:
            wanted = await self._wanted_cards(creq.allocation_size)
            chosen = ids.choose_preferred(
                creq.available_deviceIDs,
                creq.must_include_deviceIDs,
                creq.allocation_size,
                wanted,
                self.registry.card_order(),
                self.registry.cards.keys(),
                self.registry.slots,
            )
            out.append(dp.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return dp.PreferredAllocationResponse(container_responses=out)

    # -- PreStartContainer -----------------------------------------------------------------

    async def PreStartContainer(
        self, request: dp.PreStartContainerRequest, context: Ctx
    ) -> dp.PreStartContainerResponse:
        started = time.monotonic()
        try:
            written = await self.prestart(
                list(request.devices_ids), started + self.s.prestart_timeout_s
            )
        except PreStartRefused as exc:
            log.error(
                "PreStartContainer %s refused: %s", ",".join(sorted(request.devices_ids)), exc
            )
            await context.abort(exc.code, f"tessera: {exc}")
        log.info(
            "PreStartContainer %s -> %s in %.1f ms",
            ",".join(sorted(request.devices_ids)),
            ", ".join(written),
            (time.monotonic() - started) * 1000,
        )
        return dp.PreStartContainerResponse()

    async def prestart(self, raw_ids: list[str], deadline: float) -> list[str]:
        code = grpc.StatusCode
        try:
            device_ids = self._parse(raw_ids)
        except ids.DeviceIdError as exc:
            raise PreStartRefused(code.INVALID_ARGUMENT, str(exc)) from None
        sick = sorted({d.uuid for d in device_ids if not self.registry.health[d.uuid].healthy})
        if sick:
            raise PreStartRefused(
                code.FAILED_PRECONDITION, f"card(s) {', '.join(sick)} are unhealthy"
            )
        canonical = ids.canonical(device_ids)
        try:
            listed = await self.podres.list(deadline)
            holder = resolve.find_holder(canonical, listed)
            alloc = await self.source.fetch(holder.namespace, holder.pod, deadline)
            issued = self.names.names(ids.ids_digest(canonical))
            plans = resolve.plans_for(device_ids, alloc, holder, issued, self.registry.cards)
        except PodResourcesError as exc:
            raise PreStartRefused(code.UNAVAILABLE, str(exc)) from None
        except SourceUnavailable as exc:
            raise PreStartRefused(code.UNAVAILABLE, str(exc)) from None
        except NoAllocation as exc:
            raise PreStartRefused(code.FAILED_PRECONDITION, str(exc)) from None
        except (AllocationError, resolve.ResolveError, edits.PlanError, StoreError) as exc:
            raise PreStartRefused(code.FAILED_PRECONDITION, str(exc)) from None
        if self.s.device_mode == "paths":
            for plan in plans:
                for d in plan.devices:
                    if d.mode in edits.MODES_NEEDING_CDI:
                        raise PreStartRefused(
                            code.FAILED_PRECONDITION,
                            f"container {plan.container!r} has a {d.mode} slice of card "
                            f"{d.card.uuid}; {d.mode} needs CDI (TESSERA_DEVICE_MODE=cdi): in "
                            "host-path mode the environment is fixed before the pod is known",
                        )
        for plan in plans:
            await self._record(alloc, plan)
        digest = ids.ids_digest(canonical)
        try:
            plans = [await self._give_mig(plan, digest) for plan in plans]
        except MigError as exc:
            raise PreStartRefused(code.FAILED_PRECONDITION, str(exc)) from None
        try:
            for plan in plans:
                self.writer.write(plan)
        except OSError as exc:
            raise PreStartRefused(
                code.INTERNAL, f"cannot write the container's config: {exc}"
            ) from None
        return [f"{p.container}:{p.name}" for p in plans]

    async def _give_mig(self, plan: edits.ContainerPlan, digest: str) -> edits.ContainerPlan:
        """The MIG instance of each mig slice: created at the record's placement, or the one
        already there adopted (a container restart, a plugin restart); recorded as ours when
        created here, so that the release path destroys it and nothing else."""
        if not any(d.mode == MIG for d in plan.devices):
            return plan
        if self.mig is None:
            raise MigError("this plugin runs without MIG support")
        mig = self.mig
        devices = []
        for d in plan.devices:
            if d.mode != MIG or d.mig is None:
                devices.append(d)
                continue

            def record(inst: MigInstance) -> None:
                mig.record(
                    Owned(
                        inst.card,
                        inst.profile,
                        inst.start,
                        inst.size,
                        inst.gi,
                        inst.ci if inst.ci is not None else 0,
                        inst.uuid,
                        digest,
                        plan.pod_uid,
                        plan.container,
                    )
                )

            inst, created = await asyncio.to_thread(mig.ensure, d.card.uuid, d.mig, record)
            if inst.ci is None:  # ensure() fills every instance it returns; say so if not
                raise MigError(
                    f"card {d.card.uuid}: MIG instance {inst.gi} has no compute instance"
                )
            if created:
                log.info(
                    "MIG %s at %d+%d on %s created for %s/%s %s: %s",
                    inst.profile,
                    inst.start,
                    inst.size,
                    d.card.uuid,
                    plan.namespace,
                    plan.pod,
                    plan.container,
                    inst.uuid,
                )
            gi_minor, ci_minor = cap_minors(self.s.proc_root, d.card.minor, inst.gi, inst.ci)
            devices.append(
                dataclasses.replace(d, mig_device=edits.MigDevice(inst.uuid, gi_minor, ci_minor))
            )
        return dataclasses.replace(plan, devices=tuple(devices))

    async def _record(self, alloc: Allocation, plan: edits.ContainerPlan) -> None:
        """Tell the control plane which cards the container really got, before writing: a 409
        (the ledger has other cards) or 404 (no such binding, e.g. released) refuses the start
        and nothing is written; an unreachable control plane is retried in the background."""
        devices = [d.card.uuid for d in plan.devices]
        try:
            await self.cp.post_allocated(alloc.pod_uid, plan.container, devices)
        except ControlPlaneError as exc:
            if exc.status in (404, 409):
                # The ledger (the source of truth) has no such binding or other cards.
                raise PreStartRefused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
            log.error("%s (not retried)", exc)
        except HttpUnavailable as exc:
            log.warning("%s; will retry in the background", exc)
            self._pending_posts[(alloc.pod_uid, plan.container)] = devices

    async def retry_pending_posts(self) -> None:
        for (uid, container), devices in list(self._pending_posts.items()):
            try:
                await self.cp.post_allocated(uid, container, devices)
            except HttpUnavailable:
                return
            except ControlPlaneError as exc:
                log.error("%s (dropped)", exc)
            self._pending_posts.pop((uid, container), None)


class PreStartRefused(RuntimeError):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
