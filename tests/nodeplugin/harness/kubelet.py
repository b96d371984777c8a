"""The kubelet's side of the device plugin and PodResources APIs, over real unix sockets.

It does what the kubelet's device manager does, in its order: serve ``kubelet.sock``; on
Register dial the plugin back and call GetDevicePluginOptions, then keep a ListAndWatch stream
and the device set it reports; admit pods one at a time (init containers first, their devices
reusable by the next containers; GetPreferredAllocation when there is a choice; Allocate per
container, answer cached); list active pods through PodResources (regular containers only, one
device ID per entry); call PreStartContainer with a container's IDs on every start; on restart
delete every socket in the plugin directory and serve ``kubelet.sock`` anew.

Connections are kept as the device manager of the pinned kubelet keeps them (v1.37
``devicemanager/plugin/v1beta1`` and ``manager.go``): by the socket path a plugin registered.
A Register for a path that already holds a connection fails ("device plugin already connected")
and drops the clients at that path, so that connection is never disconnected (its endpoint stays,
stale); a ListAndWatch stream that ends disconnects the path's client; the last connection of the
resource to go marks every device unhealthy, while one that goes beside another hands the resource
to the other, devices as that one last reported them.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from nodeplugin.pb import dp, pr
from nodeplugin.rpc import (
    DevicePluginClient,
    pod_resources_handler,
    registration_handler,
    unix_target,
)


@dataclass
class Container:
    name: str
    count: int  # nvidia.com/gpu request (= limit)
    init: bool = False


@dataclass
class Endpoint:
    path: str
    channel: grpc.aio.Channel
    client: DevicePluginClient
    options: dp.DevicePluginOptions
    stream: asyncio.Task[None] | None = None
    dropped: bool = False  # the kubelet closed the connection itself


@dataclass
class Pod:
    namespace: str
    name: str
    containers: list[Container]
    devices: dict[str, list[str]] = field(default_factory=dict)
    responses: dict[str, dp.ContainerAllocateResponse] = field(default_factory=dict)


class AdmissionError(RuntimeError):
    pass


class FakeKubelet:
    def __init__(self, root: Path, resource: str = "nvidia.com/gpu") -> None:
        self.root = root
        self.resource = resource
        self.plugin_dir = root / "device-plugins"
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.podres_socket = root / "pod-resources" / "kubelet.sock"
        self.podres_socket.parent.mkdir(parents=True, exist_ok=True)
        self.registrations: list[tuple[float, dp.RegisterRequest]] = []
        self.refused: list[tuple[str, str]] = []  # (endpoint, why) of registrations that failed
        self.health: dict[str, str] = {}
        self.topology: dict[str, list[int]] = {}
        self.updates: list[tuple[float, dict[str, str]]] = []
        self._update = asyncio.Event()
        self.pods: dict[tuple[str, str], Pod] = {}
        self.honor_preferred = True
        self.list_calls = 0
        self.podres_exhausted = 0  # answer the next N List calls with RESOURCE_EXHAUSTED
        # the device manager's endpoint store (path -> connection) and the registration
        # server's client list (paths, one entry per client), which runs the streams
        self.endpoints: dict[str, Endpoint] = {}
        self.primary: Endpoint | None = None
        self._clients: list[str] = []
        self._reg_server: grpc.aio.Server | None = None
        self._podres_server: grpc.aio.Server | None = None

    # -- servers ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self._serve_registration()
        self._podres_server = grpc.aio.server()
        self._podres_server.add_generic_rpc_handlers(
            (pod_resources_handler(self._list, self._get),)
        )
        self._podres_server.add_insecure_port(unix_target(str(self.podres_socket)))
        await self._podres_server.start()

    async def _serve_registration(self) -> None:
        sock = self.plugin_dir / "kubelet.sock"
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        self._reg_server = grpc.aio.server()
        self._reg_server.add_generic_rpc_handlers((registration_handler(self._register),))
        self._reg_server.add_insecure_port(unix_target(str(sock)))
        await self._reg_server.start()

    @property
    def client(self) -> DevicePluginClient | None:
        return self.primary.client if self.primary is not None else None

    @property
    def options(self) -> dp.DevicePluginOptions | None:
        return self.primary.options if self.primary is not None else None

    async def _forget_connections(self) -> None:
        for ep in list(self.endpoints.values()):
            if ep.stream is not None:
                ep.stream.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await ep.stream
            await ep.channel.close()
        self.endpoints.clear()
        self._clients.clear()
        self.primary = None

    async def stop(self) -> None:
        await self._forget_connections()
        for server in (self._reg_server, self._podres_server):
            if server is not None:
                await server.stop(0)

    async def restart(self) -> None:
        """What a kubelet restart does to the plugin directory."""
        if self._reg_server is not None:
            await self._reg_server.stop(0)
        for sock in self.plugin_dir.glob("*.sock"):
            sock.unlink()
        for hidden in self.plugin_dir.glob(".*.sock*"):  # CleanupPluginDirectory: every file
            hidden.unlink()
        await self._forget_connections()
        await asyncio.sleep(0.05)
        await self._serve_registration()

    async def _register(self, request: dp.RegisterRequest, context: Any) -> dp.Empty:
        self.registrations.append((time.monotonic(), request))
        if request.version != "v1beta1" or "/" not in request.resource_name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad registration")
        path = request.endpoint
        self._clients.append(path)
        # The kubelet dials back during Register and asks for the options.
        channel = grpc.aio.insecure_channel(unix_target(str(self.plugin_dir / path)))
        client = DevicePluginClient(channel)
        try:
            options = await client.GetDevicePluginOptions(dp.Empty(), timeout=10)
        except grpc.aio.AioRpcError as exc:
            self._clients = [c for c in self._clients if c != path]
            await channel.close()
            self.refused.append((path, "cannot dial back"))
            await context.abort(grpc.StatusCode.UNKNOWN, f"cannot dial back: {exc.details()}")
        if path in self.endpoints:
            # PluginConnected refuses; connectClient then deregisters by path, taking the
            # connected client's entry along, so that one's end never disconnects its endpoint.
            self._clients = [c for c in self._clients if c != path]
            await channel.close()
            self.refused.append((path, "device plugin already connected"))
            await context.abort(grpc.StatusCode.UNKNOWN, f"device plugin already connected: {path}")
        ep = Endpoint(path, channel, client, options)
        self.endpoints[path] = ep
        self.primary = ep
        ep.stream = asyncio.create_task(self._run(ep))
        return dp.Empty()

    async def _run(self, ep: Endpoint) -> None:
        try:
            async for resp in ep.client.ListAndWatch(dp.Empty()):
                self._devices(resp)
        except grpc.aio.AioRpcError:
            pass
        except asyncio.CancelledError:
            if not ep.dropped:  # stop() or restart(), not the end of the stream
                raise
        # runClient: the client registered at this path, if any, is disconnected.
        if ep.path not in self._clients:
            return
        self._clients = [c for c in self._clients if c != ep.path]
        if not ep.dropped:
            await ep.channel.close()
        self._disconnected(ep.path)

    def _devices(self, resp: dp.ListAndWatchResponse) -> None:
        self._set_health(
            {d.ID: d.health for d in resp.devices},
            {d.ID: [n.ID for n in d.topology.nodes] for d in resp.devices},
        )

    def _set_health(self, health: dict[str, str], topology: dict[str, list[int]]) -> None:
        self.health, self.topology = health, topology
        self.updates.append((time.monotonic(), dict(self.health)))
        self._update.set()
        self._update = asyncio.Event()

    def _disconnected(self, path: str) -> None:
        """PluginDisconnected: the last connection marks every device unhealthy; otherwise
        another connection becomes the one the kubelet allocates through."""
        if path not in self.endpoints:
            return
        del self.endpoints[path]
        if self.endpoints:
            self.primary = next(iter(self.endpoints.values()))
        else:
            self._set_health({i: "Unhealthy" for i in self.health}, self.topology)

    async def drop_connection(self) -> None:
        """The kubelet closes its connection to the plugin it allocates through (as when
        another client at the same path was disconnected in its place)."""
        assert self.primary is not None
        self.primary.dropped = True
        await self.primary.channel.close()

    def streams(self) -> int:
        """ListAndWatch streams running now."""
        return sum(1 for ep in self.endpoints.values() if ep.stream and not ep.stream.done())

    async def wait_update(self, pred: Any, timeout: float = 5.0, since: int = 0) -> float:
        """Wait until ``pred(health map)`` holds for an update numbered ``since`` or later;
        returns when that update arrived (monotonic)."""
        deadline = time.monotonic() + timeout
        while True:
            for t, snap in self.updates[since:]:
                if pred(snap):
                    return t
            ev = self._update
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no ListAndWatch update satisfied the condition")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), remaining)

    async def wait_registered(self, count: int = 1, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.registrations) < count or not self.health or not self.streams():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(self.registrations)} registration(s), {len(self.health)} devices"
                )
            await asyncio.sleep(0.02)

    async def _list(
        self, request: pr.ListPodResourcesRequest, context: Any
    ) -> pr.ListPodResourcesResponse:
        self.list_calls += 1
        if self.podres_exhausted > 0:
            self.podres_exhausted -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limited")
        return pr.ListPodResourcesResponse(
            pod_resources=[self._pod_msg(p) for p in self.pods.values()]
        )

    async def _get(
        self, request: pr.GetPodResourcesRequest, context: Any
    ) -> pr.GetPodResourcesResponse:
        pod = self.pods.get((request.pod_namespace, request.pod_name))
        if pod is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such pod")
        assert pod is not None
        return pr.GetPodResourcesResponse(pod_resources=self._pod_msg(pod))

    def _pod_msg(self, pod: Pod) -> pr.PodResources:
        containers = []
        for c in pod.containers:
            if c.init:
                continue  # ordinary init containers are not listed
            devs = [
                pr.ContainerDevices(resource_name=self.resource, device_ids=[i])
                for i in pod.devices.get(c.name, [])
            ]
            containers.append(pr.ContainerResources(name=c.name, devices=devs))
        return pr.PodResources(name=pod.name, namespace=pod.namespace, containers=containers)

    # -- device manager --------------------------------------------------------------------

    def in_use(self) -> set[str]:
        used: set[str] = set()
        for p in self.pods.values():
            for ids in p.devices.values():
                used |= set(ids)
        return used

    async def admit(self, pod: Pod) -> Pod:
        assert self.client is not None, "no plugin registered"
        self.pods[(pod.namespace, pod.name)] = pod
        reusable: list[str] = []
        try:
            order = [c for c in pod.containers if c.init] + [
                c for c in pod.containers if not c.init
            ]
            for c in order:
                if c.count == 0:
                    continue
                chosen = reusable[: c.count]
                need = c.count - len(chosen)
                if need > 0:
                    free = sorted(
                        i
                        for i, h in self.health.items()
                        if h == "Healthy" and i not in self.in_use() and i not in chosen
                    )
                    if len(free) < need:
                        raise AdmissionError(
                            f"{pod.name}/{c.name}: {need} devices wanted, {len(free)} free"
                        )
                    picked: list[str] = []
                    if (
                        self.honor_preferred
                        and need < len(free)
                        and self.options is not None
                        and self.options.get_preferred_allocation_available
                    ):
                        resp = await self.client.GetPreferredAllocation(
                            dp.PreferredAllocationRequest(
                                container_requests=[
                                    dp.ContainerPreferredAllocationRequest(
                                        available_deviceIDs=free + chosen,
                                        must_include_deviceIDs=chosen,
                                        allocation_size=c.count,
                                    )
                                ]
                            ),
                            timeout=10,
                        )
                        picked = [i for i in resp.container_responses[0].deviceIDs if i in free][
                            :need
                        ]
                    if not self.honor_preferred:
                        random.shuffle(free)
                    for i in free:
                        if len(picked) >= need:
                            break
                        if i not in picked:
                            picked.append(i)
                    chosen = chosen + picked
                shuffled = list(chosen)
                random.shuffle(shuffled)  # the kubelet hands IDs over in no particular order
                resp_a = await self.client.Allocate(
                    dp.AllocateRequest(
                        container_requests=[dp.ContainerAllocateRequest(devices_ids=shuffled)]
                    ),
                    timeout=10,
                )
                pod.responses[c.name] = resp_a.container_responses[0]
                pod.devices[c.name] = chosen
                # init containers' devices are reusable by the containers that follow
                reusable = list(chosen) if c.init else [i for i in reusable if i not in chosen]
        except BaseException:
            del self.pods[(pod.namespace, pod.name)]
            raise
        return pod

    async def start_container(self, pod: Pod, container: str) -> dp.PreStartContainerResponse:
        """PreStartContainer with the container's IDs (shuffled), as before CRI CreateContainer."""
        assert self.client is not None
        ids = list(pod.devices[container])
        random.shuffle(ids)
        resp: dp.PreStartContainerResponse = await self.client.PreStartContainer(
            dp.PreStartContainerRequest(devices_ids=ids), timeout=30
        )
        return resp

    def remove(self, pod: Pod) -> None:
        self.pods.pop((pod.namespace, pod.name), None)
