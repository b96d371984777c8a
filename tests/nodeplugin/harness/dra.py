"""The kubelet's DRA side and the API server's DRA resources, for the node plugin's DRA mode.

:class:`FakeDraKubelet` does what the pinned kubelet (v1.37) does with a DRA driver, over real
unix sockets and the real gRPC APIs: its plugin watcher scans the registry directory for sockets
(not dot-files), dials each new one (or one re-created: a new inode or link, as fsnotify's
create event tells the real one), calls ``GetInfo``, accepts
type ``DRAPlugin`` with a supported service it serves (``v1.DRAPlugin`` or
``v1beta1.DRAPlugin``), says so with ``NotifyRegistrationStatus``, and keeps one endpoint per
driver; a socket that goes deregisters its driver. ``prepare``/``unprepare`` call the
registered endpoint as the DRA manager does. ``restart`` forgets every registration and scans
again, as a restarted kubelet does (it leaves the registry directory alone).

:class:`FakeKubeApi` serves the few ``resource.k8s.io/v1`` calls the plugin makes, behind a
bearer token: ResourceClaims by namespace and name, ResourceSlices listed by field selector,
created, replaced (with the resourceVersion they replace) and deleted (with a UID precondition).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.parse
import uuid as uuidlib
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from nodeplugin.dra_rpc import PLUGIN_TYPE, DraPluginClient, RegistrationClient
from nodeplugin.pb import dra, reg
from nodeplugin.rpc import unix_target
from tests.nodeplugin.harness.jsonhttp import JsonHandler

KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
RESOURCE = "/apis/resource.k8s.io/v1"


@dataclass
class Registered:
    socket: Path
    inode: tuple[int, int]
    info: reg.PluginInfo
    channel: grpc.aio.Channel
    client: DraPluginClient


class FakeDraKubelet:
    def __init__(self, root: Path, poll_s: float = 0.05) -> None:
        self.registry_dir = root / "plugins_registry"
        self.plugins_dir = root / "plugins"
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        self.plugins_dir.mkdir(parents=True, exist_ok=True)
        self.poll_s = poll_s
        self.drivers: dict[str, Registered] = {}
        self.seen: dict[Path, tuple[int, int]] = {}  # socket -> (inode, ctime) handled
        self.infos: list[reg.PluginInfo] = []  # every GetInfo answer, in order
        self.refused: list[tuple[str, str]] = []  # (socket, why)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for r in self.drivers.values():
            await r.channel.close()
        self.drivers.clear()
        self.seen.clear()

    async def restart(self) -> None:
        await self.stop()
        await asyncio.sleep(0.05)
        await self.start()

    async def _watch(self) -> None:
        while True:
            present: dict[Path, tuple[int, int]] = {}
            for path in self.registry_dir.iterdir():
                if path.name.startswith(".") or not path.is_socket():
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = path.stat()
                    present[path] = (st.st_ino, st.st_ctime_ns)
            for path in [p for p in self.seen if p not in present]:
                del self.seen[path]
                for name, r in list(self.drivers.items()):
                    if r.socket == path:
                        del self.drivers[name]
                        await r.channel.close()
            for path, inode in present.items():
                if self.seen.get(path) != inode:
                    self.seen[path] = inode
                    await self._register(path, inode)
            await asyncio.sleep(self.poll_s)

    async def _register(self, path: Path, inode: tuple[int, int]) -> None:
        async with grpc.aio.insecure_channel(unix_target(str(path))) as ch:
            client = RegistrationClient(ch)
            try:
                info = await client.GetInfo(reg.InfoRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                self.refused.append((str(path), f"GetInfo: {exc.details()}"))
                return
            self.infos.append(info)
            why = ""
            if info.type != PLUGIN_TYPE:
                why = f"type {info.type!r} is not {PLUGIN_TYPE}"
            elif not any(v in KUBELET_SERVICES for v in info.supported_versions):
                why = f"none of {list(info.supported_versions)} is served by the kubelet"
            elif not Path(info.endpoint).is_absolute():
                why = f"endpoint {info.endpoint!r} is not an absolute path"
            if why:
                self.refused.append((str(path), why))
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await client.NotifyRegistrationStatus(
                        reg.RegistrationStatus(plugin_registered=False, error=why), timeout=5
                    )
                return
            old = self.drivers.pop(info.name, None)
            if old is not None:
                await old.channel.close()
            channel = grpc.aio.insecure_channel(unix_target(info.endpoint))
            self.drivers[info.name] = Registered(
                path, inode, info, channel, DraPluginClient(channel)
            )
            await client.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=True), timeout=5
            )

    async def wait_registered(self, driver: str, timeout: float = 15.0) -> Registered:
        deadline = time.monotonic() + timeout
        while driver not in self.drivers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"driver {driver} did not register (refused: {self.refused})")
            await asyncio.sleep(0.02)
        return self.drivers[driver]

    def _client(self, driver: str) -> DraPluginClient:
        r = self.drivers.get(driver)
        if r is None:
            raise AssertionError(f"driver {driver} is not registered")
        return r.client

    async def prepare(
        self, driver: str, *claims: tuple[str, str, str]
    ) -> dict[str, dra.NodePrepareResourceResponse]:
        """``claims``: (namespace, name, uid); the answers by UID."""
        req = dra.NodePrepareResourcesRequest(claims=_claims(claims))
        resp = await self._client(driver).NodePrepareResources(req, timeout=45)
        return dict(resp.claims)

    async def unprepare(
        self, driver: str, *claims: tuple[str, str, str]
    ) -> dict[str, dra.NodeUnprepareResourceResponse]:
        req = dra.NodeUnprepareResourcesRequest(claims=_claims(claims))
        resp = await self._client(driver).NodeUnprepareResources(req, timeout=45)
        return dict(resp.claims)


def container_cdi_ids(answer: dra.NodePrepareResourceResponse, *requests: str) -> list[str]:
    """The CDI IDs the kubelet gives a container from a claim's prepare answer, as the pinned
    kubelet's ``GetResources`` and ``cdiDevicesAsList`` do (``pkg/kubelet/cm/dra/manager.go``,
    ``claiminfo.go``): for each request the container names in ``resources.claims`` (``""``:
    it names the whole claim), in that order, every device's IDs, in the answer's order,
    when the name is ``""``, the device names no request, or its request names contain it;
    repeats are kept."""
    out: list[str] = []
    for request in requests:
        for device in answer.devices:
            names = list(device.request_names)
            if request == "" or not names or request in names:
                out += list(device.cdi_device_ids)
    return out


def _claims(refs: tuple[tuple[str, str, str], ...]) -> list[dra.Claim]:
    return [dra.Claim(namespace=ns, name=n, uid=u) for ns, n, u in refs]


class FakeKubeApi:
    def __init__(self, token: str) -> None:
        self.token = token
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.slices: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every authorized call
        self.lock = threading.Lock()
        self._version = 0
        api = self

        class Handler(JsonHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                if self.headers.get("Authorization") != f"Bearer {api.token}":
                    self.send_json(401, {"kind": "Status", "message": "Unauthorized"})
                    return
                url = urllib.parse.urlsplit(self.path)
                with api.lock:
                    api.requests.append((self.command, url.path))
                    status, body = api.route(
                        self.command, url.path, urllib.parse.parse_qs(url.query), raw
                    )
                self.send_json(status, body)

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def add_claim(self, claim: dict[str, Any]) -> None:
        meta = claim["metadata"]
        with self.lock:
            self.claims[(meta["namespace"], meta["name"])] = claim

    def remove_claim(self, namespace: str, name: str) -> None:
        with self.lock:
            self.claims.pop((namespace, name), None)

    def slice_writes(self) -> int:
        with self.lock:
            return sum(1 for m, p in self.requests if m != "GET" and "resourceslices" in p)

    @staticmethod
    def _status(code: int, message: str) -> tuple[int, dict[str, Any]]:
        return code, {"kind": "Status", "code": code, "message": message}

    def route(
        self, method: str, path: str, query: dict[str, list[str]], raw: bytes
    ) -> tuple[int, Any]:
        parts = path.removeprefix(RESOURCE).strip("/").split("/")
        if method == "GET" and len(parts) == 4 and parts[0] == "namespaces":
            claim = self.claims.get((parts[1], parts[3]))
            return (200, claim) if claim is not None else self._status(404, "not found")
        if parts[0] != "resourceslices":
            return self._status(404, f"no route {method} {path}")
        body = json.loads(raw) if raw else None
        if method == "GET" and len(parts) == 1:
            wanted = dict(
                kv.split("=", 1) for kv in query.get("fieldSelector", [""])[0].split(",") if kv
            )
            items = [
                s
                for s in self.slices.values()
                if all(
                    {
                        "spec.nodeName": s["spec"].get("nodeName"),
                        "spec.driver": s["spec"]["driver"],
                    }[k]
                    == v
                    for k, v in wanted.items()
                )
            ]
            return 200, {"kind": "ResourceSliceList", "items": json.loads(json.dumps(items))}
        if method == "POST" and len(parts) == 1:
            name = body["metadata"]["name"]
            if name in self.slices:
                return self._status(409, f"resourceslices {name} already exists")
            body["metadata"]["uid"] = str(uuidlib.uuid4())
            body["metadata"]["resourceVersion"] = self._next_version()
            self.slices[name] = body
            return 201, body
        name = parts[1] if len(parts) == 2 else ""
        have = self.slices.get(name)
        if have is None:
            return self._status(404, f"resourceslices {name} not found")
        if method == "PUT":
            if body["metadata"].get("resourceVersion") != have["metadata"]["resourceVersion"]:
                return self._status(409, "the object has been modified")
            body["metadata"]["uid"] = have["metadata"]["uid"]
            body["metadata"]["resourceVersion"] = self._next_version()
            self.slices[name] = body
            return 200, body
        if method == "DELETE":
            pre = (body or {}).get("preconditions") or {}
            if pre.get("uid") not in (None, have["metadata"]["uid"]):
                return self._status(409, "Precondition failed: UID in precondition")
            del self.slices[name]
            return 200, {"kind": "Status", "status": "Success"}
        return self._status(405, f"{method} {path}")
