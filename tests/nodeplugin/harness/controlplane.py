"""A fake control plane on loopback that follows docs/allocation.md and DESIGN §7 exactly.

Endpoints (all need ``Authorization: Bearer <token>`` of a node identity):

- ``PUT /api/v1/nodes/<name>/inventory``: the body must have exactly the keys of DESIGN §7,
  plus an optional ``usage`` list (docs/nodeplugin.md); 201 on the first report of a node, then
  200; 403 for another node's token; 400 naming ``usage`` when ``takes_usage`` is off (a
  control plane that predates it), naming the virtual device memory keys when ``takes_memory``
  is off.
- ``GET /api/v1/allocations/<namespace>/<name>``: the record; 404 without one; 403 when the
  record is on another node than the token's.
- ``POST /api/v1/allocations/<pod_uid>/containers/<container>/allocated`` with
  ``{"devices": [...]}``: 200, or 409 when the devices differ from the record's.

It also answers ``GET /api/v1/namespaces/<ns>/pods/<name>`` like the API server (for the
signed-annotation mode).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from typing import Any

from nodeplugin import allocation as alloc_mod
from tests.nodeplugin.harness.jsonhttp import JsonHandler

INVENTORY_KEYS = {"plugin_version", "cards"}
# Virtual device memory (docs/nodeplugin.md): a node that oversubscribes says so at the top
# level, and each usage entry says what is resident and what spilled.
MEMORY_KEYS = {"memory_oversubscription", "spill_reserve_mib", "host_memory_mib"}
USAGE_KEYS = {
    "namespace", "pod", "container", "card", "memory_used_mib", "compute_used_percent",
}  # fmt: skip
SPILL_USAGE_KEYS = {"memory_resident_mib", "memory_spilled_mib"}
CARD_KEYS = {"uuid", "index", "model", "memory_mib", "numa_node", "healthy", "health_reason"}
# docs/card-modes.md: a MIG-capable card's report may carry this, and nothing else is optional.
OPTIONAL_CARD_KEYS = {"mig"}
MIG_KEYS = {"capable", "enabled", "instances"}
MIG_INSTANCE_KEYS = {"profile", "start", "size", "uuid"}


def _card_ok(card: dict[str, Any]) -> bool:
    if not CARD_KEYS <= set(card) <= CARD_KEYS | OPTIONAL_CARD_KEYS:
        return False
    mig = card.get("mig")
    if mig is None:
        return True
    return (
        isinstance(mig, dict)
        and set(mig) == MIG_KEYS
        and all(set(i) == MIG_INSTANCE_KEYS for i in mig["instances"])
    )


def record(
    pod_uid: str,
    namespace: str,
    name: str,
    node: str,
    containers: list[tuple[str, int, bool, list[tuple[str, int, int]]]],
    priorities: dict[str, int] | None = None,
    modes: dict[str, dict[str, Any]] | None = None,
) -> str:
    """The compact, key-sorted JSON the extender writes (docs/allocation.md); ``priorities``
    by container name, for the containers whose pod asked for nvidia.com/priority; ``modes``
    by card UUID, the device keys of a card in a mode (docs/card-modes.md), e.g.
    ``{"mode": "mig", "mig": {"profile": "3g.40gb", "start": 4, "size": 4}}``."""
    rows: list[dict[str, Any]] = []
    for cname, index, init, devices in containers:
        row: dict[str, Any] = {
            "name": cname,
            "index": index,
            "init": init,
            "devices": [
                {"uuid": u, "memory_mib": m, "cores": c, **(modes or {}).get(u, {})}
                for u, m, c in devices
            ],
        }
        if priorities and cname in priorities:
            row["priority"] = priorities[cname]
        rows.append(row)
    body = {
        "v": 1,
        "pod_uid": pod_uid,
        "namespace": namespace,
        "name": name,
        "node": node,
        "containers": rows,
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


@dataclass
class FakePodObject:
    uid: str
    node_name: str
    annotations: dict[str, str] = field(default_factory=dict)


class FakeControlPlane:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.tokens: dict[str, str] = {}
        self.allocations: dict[tuple[str, str], str] = {}
        self.pods: dict[tuple[str, str], FakePodObject] = {}
        self.reports: list[tuple[float, str, dict[str, Any]]] = []
        self.allocated: list[tuple[str, str, list[str]]] = []
        self.requests: list[tuple[str, str, int]] = []
        self.status_override: int | None = None  # e.g. 503: the control plane is "down"
        self.modes: dict[str, str] | None = None  # the answer's "modes"; None: no such key
        self.takes_usage = True  # False: refuse a report with `usage`, as an older one does
        # False: refuse a report with the node's oversubscription keys, as an older one does
        self.takes_memory = True
        # Seconds a report whose cards are all healthy takes to be handled (a slow heartbeat);
        # `healthy_report_arrived` is set when one arrives.
        self.healthy_report_delay = 0.0
        self.healthy_report_arrived = threading.Event()
        self.lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        self.host = host
        self._port = port
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._port}"

    def start(self) -> None:
        plane = self

        class Handler(JsonHandler):
            def setup(self) -> None:
                super().setup()
                # like production servers: no Nagle delay between the headers and the body
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with plane.lock:
                    plane.connections.add(self.connection)

            def finish(self) -> None:
                with plane.lock:
                    plane.connections.discard(self.connection)
                super().finish()

            def _send(self, status: int, body: Any) -> None:
                self.send_json(status, body)
                with plane.lock:
                    plane.requests.append((self.command, self.path, status))

            def _node(self) -> str | None:
                auth = self.headers.get("Authorization", "")
                if not auth.startswith("Bearer "):
                    return None
                return plane.tokens.get(auth[len("Bearer ") :])

            def _body(self) -> Any:
                n = int(self.headers.get("Content-Length", "0"))
                return json.loads(self.rfile.read(n)) if n else None

            def _handle(self) -> None:
                body = self._body() if self.command in ("PUT", "POST") else None
                if plane.status_override is not None:
                    self._send(plane.status_override, {"error": "control plane unavailable"})
                    return
                node = self._node()
                if node is None:
                    self._send(401, {"error": "authentication required"})
                    return
                parts = [urllib.parse.unquote(p) for p in self.path.split("/") if p]
                self.route(parts, node, body)

            def route(self, parts: list[str], node: str, body: Any) -> None:
                cmd = self.command
                if (
                    cmd == "PUT"
                    and len(parts) == 5
                    and parts[:3] == ["api", "v1", "nodes"]
                    and parts[4] == "inventory"
                ):
                    name = parts[3]
                    if name != node:
                        self._send(403, {"error": f"token of {node} cannot report {name}"})
                        return
                    if isinstance(body, dict) and "usage" in body and not plane.takes_usage:
                        self._send(400, {"usage": ["Unknown field."]})
                        return
                    memory = set(body) & MEMORY_KEYS if isinstance(body, dict) else set()
                    if memory and not plane.takes_memory:
                        self._send(400, {k: ["Unknown field."] for k in sorted(memory)})
                        return
                    if (
                        not isinstance(body, dict)
                        or set(body) - {"usage"} - MEMORY_KEYS != INVENTORY_KEYS
                        or (memory and "memory_oversubscription" not in memory)
                        or not all(_card_ok(c) for c in body["cards"])
                        or not all(
                            set(u) - SPILL_USAGE_KEYS == USAGE_KEYS
                            and set(u) & SPILL_USAGE_KEYS in (set(), SPILL_USAGE_KEYS)
                            for u in body.get("usage", [])
                        )
                    ):
                        self._send(400, {"error": f"not the DESIGN §7 shape: {body!r}"})
                        return
                    if all(c["healthy"] for c in body["cards"]):
                        plane.healthy_report_arrived.set()
                        time.sleep(plane.healthy_report_delay)
                    with plane.lock:
                        first = not any(r[1] == name for r in plane.reports)
                        plane.reports.append((time.monotonic(), name, body))
                    answer: dict[str, Any] = {"node": name}
                    if plane.modes is not None:
                        answer["modes"] = dict(plane.modes)
                    self._send(201 if first else 200, answer)
                    return
                if cmd == "GET" and len(parts) == 5 and parts[:3] == ["api", "v1", "allocations"]:
                    raw = plane.allocations.get((parts[3], parts[4]))
                    if raw is None:
                        self._send(404, {"error": "no active binding"})
                        return
                    data = json.loads(raw)
                    if data.get("node") != node:
                        self._send(403, {"error": "allocation on another node"})
                        return
                    self._send(200, data)
                    return
                if (
                    cmd == "POST"
                    and len(parts) == 7
                    and parts[:3] == ["api", "v1", "allocations"]
                    and parts[4] == "containers"
                    and parts[6] == "allocated"
                ):
                    uid, container = parts[3], parts[5]
                    for raw in plane.allocations.values():
                        data = json.loads(raw)
                        if data["pod_uid"] != uid:
                            continue
                        for c in data["containers"]:
                            if c["name"] == container:
                                want = [d["uuid"] for d in c["devices"]]
                                if not isinstance(body, dict) or body.get("devices") != want:
                                    self._send(409, {"error": f"ledger has {want}"})
                                    return
                                with plane.lock:
                                    plane.allocated.append((uid, container, want))
                                self._send(200, {"phase": "allocated"})
                                return
                    self._send(404, {"error": "no such binding or container"})
                    return
                if (
                    cmd == "GET"
                    and len(parts) == 6
                    and parts[:3] == ["api", "v1", "namespaces"]
                    and parts[4] == "pods"
                ):
                    pod = plane.pods.get((parts[3], parts[5]))
                    if pod is None:
                        self._send(404, {"kind": "Status", "reason": "NotFound"})
                        return
                    self._send(
                        200,
                        {
                            "kind": "Pod",
                            "metadata": {
                                "name": parts[5],
                                "namespace": parts[3],
                                "uid": pod.uid,
                                "annotations": pod.annotations,
                            },
                            "spec": {"nodeName": pod.node_name},
                        },
                    )
                    return
                self._send(404, {"error": f"no route {cmd} {self.path}"})

            do_GET = _handle
            do_PUT = _handle
            do_POST = _handle

        self.server = ThreadingHTTPServer((self.host, self._port), Handler)
        self.server.daemon_threads = True
        self._port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Really down: the port refuses connections until :meth:`start`."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
            with self.lock:
                for conn in list(self.connections):  # keep-alive connections die too
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)

    # -- builders ---------------------------------------------------------------------------

    def add_token(self, token: str, node: str) -> None:
        self.tokens[token] = node

    def bind(self, raw_record: str, *, key: bytes | None = None, annotations: bool = True) -> None:
        """What the extender's bind leaves behind: the ledger record and the pod annotations."""
        data = json.loads(raw_record)
        self.allocations[(data["namespace"], data["name"])] = raw_record
        ann = {}
        if annotations:
            ann[alloc_mod.ANNOTATION] = raw_record
            if key is not None:
                ann[alloc_mod.SIGNATURE_ANNOTATION] = alloc_mod.sign(raw_record, key)
        self.pods[(data["namespace"], data["name"])] = FakePodObject(
            data["pod_uid"], data["node"], ann
        )
