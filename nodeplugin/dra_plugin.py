"""The kubelet's DRA plugin: the ``DRAPlugin`` v1 service and its registration (docs/dra.md).

The kubelet's plugin watcher finds the registration socket in its registry directory, asks
``GetInfo`` (type ``DRAPlugin``, the driver, the endpoint, the services served), dials the
endpoint and says how that went with ``NotifyRegistrationStatus``. It calls
``NodePrepareResources`` before a pod's containers start and ``NodeUnprepareResources`` after
the pod is gone; both name claims only by namespace, name and UID, so prepare reads the
ResourceClaim from the API server and hands it to :class:`~nodeplugin.dra_claims.ClaimPreparer`.

Serving follows the device plugin (docs/nodeplugin.md): serve, confirm the socket answers, then
register (the registration socket appears under its well-known name by an atomic rename, so the
watcher never dials a socket that does not answer yet); serve and register again when a socket
is removed. A kubelet that restarts finds the registration socket where it was and registers
the plugin again by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import grpc.aio

from nodeplugin.dra_claims import (
    ClaimError,
    ClaimPreparer,
    PreparedClaim,
    Published,
    base_request,
)
from nodeplugin.dra_paths import (
    REGISTRATION_SOCKET,
    TOKEN_HEX,
    endpoint_name,
    private_registration_name,
)
from nodeplugin.dra_rpc import (
    DRA_SUPPORTED_VERSION,
    PLUGIN_TYPE,
    Context,
    DraPluginClient,
    dra_plugin_handler,
    registration_handler,
)
from nodeplugin.dra_slices import DRIVER
from nodeplugin.http import HttpUnavailable
from nodeplugin.kubeapi import KubeApiError
from nodeplugin.pb import dra, reg
from nodeplugin.rpc import unix_target
from nodeplugin.sockets import inode, remove_dead_sockets

log = logging.getLogger("nodeplugin.dra")
SELF_CHECK_TIMEOUT_S = 5.0


class ClaimReader(Protocol):
    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any] | None: ...


def prepare_answer(prepared: PreparedClaim) -> dra.NodePrepareResourceResponse:
    """The kubelet's answer for a prepared claim: per allocation result, its request (a
    subrequest counted as its request), pool, device and share ID. Each request's CDI ID goes on
    that request's first device only: the kubelet gives a container the CDI IDs of every device
    of the requests it names (all of them when it names the whole claim), repeats included, and
    one spec holds a request's devices (docs/dra.md, *Containers and requests*)."""
    out = dra.NodePrepareResourceResponse()
    ids = prepared.cdi_ids()
    for d in prepared.devices:
        request = base_request(d.request)
        device = out.devices.add(
            request_names=[request],
            pool_name=d.pool,
            device_name=d.device,
            cdi_device_ids=[ids.pop(request)] if request in ids else [],
        )
        if d.share_id is not None:
            device.share_id = d.share_id
    return out


class DraServicer:
    """``NodePrepareResources`` / ``NodeUnprepareResources``. One claim at a time: the
    preparer's check that a device is free and its checkpoint write must not interleave."""

    def __init__(
        self,
        claims: ClaimReader,
        preparer: ClaimPreparer,
        published: Callable[[], Published],
    ) -> None:
        self.claims = claims
        self.preparer = preparer
        self.published = published
        self._lock = asyncio.Lock()

    async def _prepared(self, claim: dra.Claim) -> PreparedClaim:
        done = self.preparer.store.get(claim.uid)
        if done is not None and all(
            self.preparer.writer.cdi_path(name).exists() for name in done.plan_names().values()
        ):
            return done  # prepared before (this process or another): answered as then
        obj = await self.claims.get_resource_claim(claim.namespace, claim.name)
        if obj is None:
            raise ClaimError(f"claim {claim.namespace}/{claim.name}: not found")
        uid = str((obj.get("metadata") or {}).get("uid", ""))
        if uid != claim.uid:
            raise ClaimError(
                f"claim {claim.namespace}/{claim.name} has UID {uid}, not {claim.uid} (the claim "
                "was replaced by another of the same name)"
            )
        return await asyncio.to_thread(self.preparer.prepare, obj, self.published())

    async def prepare_one(self, claim: dra.Claim) -> dra.NodePrepareResourceResponse:
        try:
            async with self._lock:
                prepared = await self._prepared(claim)
        except (ClaimError, KubeApiError, HttpUnavailable, OSError) as exc:
            log.warning("prepare %s/%s (%s): %s", claim.namespace, claim.name, claim.uid, exc)
            return dra.NodePrepareResourceResponse(error=str(exc))
        log.info(
            "prepared claim %s/%s (%s): %s",
            claim.namespace,
            claim.name,
            claim.uid,
            ", ".join(f"{d.device} {d.memory_mib} MiB {d.cores}%" for d in prepared.devices),
        )
        return prepare_answer(prepared)

    async def unprepare_one(self, claim: dra.Claim) -> dra.NodeUnprepareResourceResponse:
        try:
            async with self._lock:
                known = self.preparer.store.get(claim.uid) is not None
                await asyncio.to_thread(self.preparer.unprepare, claim.uid)
        except (ClaimError, OSError) as exc:
            log.warning("unprepare %s/%s (%s): %s", claim.namespace, claim.name, claim.uid, exc)
            return dra.NodeUnprepareResourceResponse(error=str(exc))
        if known:
            log.info("unprepared claim %s/%s (%s)", claim.namespace, claim.name, claim.uid)
        return dra.NodeUnprepareResourceResponse()

    async def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: Context
    ) -> dra.NodePrepareResourcesResponse:
        out = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            out.claims[claim.uid].CopyFrom(await self.prepare_one(claim))
        return out

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: Context
    ) -> dra.NodeUnprepareResourcesResponse:
        out = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            out.claims[claim.uid].CopyFrom(await self.unprepare_one(claim))
        return out


class Registrar:
    """The registration socket's service: what the kubelet's plugin watcher asks and tells."""

    def __init__(self, endpoint: Callable[[], Path], on_registered: Callable[[], None]) -> None:
        self.endpoint = endpoint
        self.on_registered = on_registered
        self.registrations = 0
        self.last_error = ""

    async def GetInfo(self, request: reg.InfoRequest, context: Context) -> reg.PluginInfo:
        return reg.PluginInfo(
            type=PLUGIN_TYPE,
            name=DRIVER,
            endpoint=str(self.endpoint()),
            supported_versions=[DRA_SUPPORTED_VERSION],
        )

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: Context
    ) -> reg.RegistrationStatusResponse:
        if request.plugin_registered:
            self.registrations += 1
            self.last_error = ""
            log.info("the kubelet registered DRA driver %s at %s", DRIVER, self.endpoint())
            self.on_registered()
        else:
            self.last_error = request.error
            log.error("the kubelet refused DRA driver %s: %s", DRIVER, request.error)
        return reg.RegistrationStatusResponse()


@dataclass
class _Served:
    dra: grpc.aio.Server
    registration: grpc.aio.Server
    endpoint: Path  # this process's DRA socket, named in GetInfo
    private_registration: Path
    public_inode: tuple[int, int] | None = None


class DraServer:
    """The two sockets: the DRA service on a socket of this process's own in the driver's
    directory, and the registration socket under the well-known name in the kubelet's registry
    directory. The endpoint is unique per start, so when the DaemonSet's next pod registers
    while this one terminates, the kubelet dials the new one and this one's end removes
    nothing of its successor's."""

    def __init__(
        self,
        registry_dir: Path,
        plugin_dir: Path,
        servicer: DraServicer,
        on_registered: Callable[[], None],
    ) -> None:
        self.registry_dir = registry_dir
        self.plugin_dir = plugin_dir
        self.servicer = servicer
        self.registrar = Registrar(self._endpoint, on_registered)
        self.served: _Served | None = None

    @property
    def registration_path(self) -> Path:
        return self.registry_dir / REGISTRATION_SOCKET

    def _endpoint(self) -> Path:
        if self.served is None:
            raise RuntimeError("not serving")
        return self.served.endpoint

    async def start(self) -> None:
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        remove_dead_sockets(self.plugin_dir, "dra-*.sock")
        remove_dead_sockets(self.registry_dir, f".{DRIVER}-*")
        token = secrets.token_hex(
            TOKEN_HEX // 2
        )  # unique per start: in a pod every plugin is PID 1
        endpoint = self.plugin_dir / endpoint_name(token)
        private = self.registry_dir / private_registration_name(token)
        dra_server = grpc.aio.server()
        dra_server.add_generic_rpc_handlers((dra_plugin_handler(self.servicer),))
        dra_server.add_insecure_port(unix_target(str(endpoint)))
        await dra_server.start()
        registration = grpc.aio.server()
        registration.add_generic_rpc_handlers((registration_handler(self.registrar),))
        registration.add_insecure_port(unix_target(str(private)))
        await registration.start()
        self.served = _Served(dra_server, registration, endpoint, private)
        await self._confirm_serving(endpoint)
        self._publish_registration()
        log.info("serving DRA driver %s on %s", DRIVER, endpoint)

    @staticmethod
    async def _confirm_serving(endpoint: Path) -> None:
        """Call the service as the kubelet will, with no claims: nothing is prepared."""
        async with grpc.aio.insecure_channel(unix_target(str(endpoint))) as ch:
            answer = await DraPluginClient(ch).NodePrepareResources(
                dra.NodePrepareResourcesRequest(), timeout=SELF_CHECK_TIMEOUT_S
            )
        if answer.claims:
            raise RuntimeError("self-check: an empty prepare answered claims")

    def _publish_registration(self) -> None:
        """Give the registration socket its well-known name (a hard link renamed into place):
        the plugin watcher sees it appear complete, and ignores the private dot-name."""
        assert self.served is not None
        private = self.served.private_registration
        link = private.with_name(private.name + ".link")
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        os.link(private, link)
        os.replace(link, self.registration_path)
        self.served.public_inode = inode(self.registration_path)

    async def stop(self, grace: float) -> None:
        served, self.served = self.served, None
        if served is None:
            return
        # Only our own registration: a successor's under the same name is left to serve.
        if served.public_inode is not None and inode(self.registration_path) == served.public_inode:
            with contextlib.suppress(FileNotFoundError):
                self.registration_path.unlink()
        await served.registration.stop(grace)
        await served.dra.stop(grace)
        for path in (served.private_registration, served.endpoint):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def successor_serves(self) -> bool:
        current = inode(self.registration_path)
        return (
            self.served is not None and current is not None and current != self.served.public_inode
        )

    async def check(self) -> None:
        """Serve again when a socket of ours was removed (a kubelet or an operator cleaning
        the directories): the kubelet only knows a plugin whose socket it can find."""
        served = self.served
        if (
            served is None
            or not served.endpoint.exists()
            or not served.private_registration.exists()
        ):
            log.warning("a DRA socket of ours is gone; serving and registering again")
            await self.stop(0)
            await self.start()
            return
        if inode(self.registration_path) is None:
            log.warning("%s is gone; registering again", self.registration_path)
            self._publish_registration()

    async def watch(self, stopping: asyncio.Event, poll_s: float) -> None:
        while not stopping.is_set():
            try:
                await self.check()
            except (OSError, RuntimeError, grpc.aio.AioRpcError) as exc:
                log.error("DRA sockets: %s; retrying", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), poll_s)
