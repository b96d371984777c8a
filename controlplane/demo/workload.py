"""The embedded demo's living workload (DESIGN §7): pods arrive, are scheduled through the real
extender endpoints over HTTP, run a while and end.

It plays three parts a cluster would: users (create pods in the embedded stand-in), kube-scheduler
(filter -> prioritize -> bind over HTTP, the same JSON the real scheduler sends) and the
kubelet/reconciler (mark bound pods Running; when a pod ends, delete it and release its binding).
"""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import connections

from controlplane.kube.base import KubeError
from controlplane.kube.embedded import EmbeddedKube
from controlplane.ledger.models import Node
from controlplane.ledger.services import bindings

# (namespace, image, gpus, MiB per GPU or None, percent of memory or None, cores, lifetime s)
CATALOGUE: tuple[tuple[str, str, int, int | None, int | None, int, tuple[int, int]], ...] = (
    ("team-a", "notebook", 1, 4096, None, 10, (20, 90)),
    ("team-a", "trainer", 2, 20000, None, 50, (40, 150)),
    ("team-b", "inference", 1, 8000, None, 25, (30, 120)),
    ("team-b", "embedder", 1, None, 25, 20, (20, 60)),
    ("ml-research", "finetune", 4, 40000, None, 100, (60, 200)),
    ("ml-research", "eval", 1, 12000, None, 0, (10, 40)),
)
MAX_PENDING_TICKS = 30


@dataclass
class DemoPod:
    namespace: str
    name: str
    uid: str
    ends_at: float
    node: str = ""
    tries: int = 0


class DemoWorkload:
    """One demo loop. `report` re-sends the demo nodes' inventory (their heartbeat)."""

    def __init__(
        self,
        url: str,
        *,
        report: Callable[[], object],
        log: Callable[[str], object],
        seed: int | None = None,
        arrivals: tuple[int, int] = (0, 3),
    ) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.report, self.log = report, log
        self.rng = random.Random(seed)
        self.arrivals = arrivals
        self.kube = EmbeddedKube()
        self.pods: dict[str, DemoPod] = {}
        self.serial = 0
        self._http: http.client.HTTPConnection | None = None

    # --- the scheduler's side ------------------------------------------------------------------

    def _post(self, verb: str, body: dict[str, Any]) -> Any:
        for attempt in range(2):
            if self._http is None:
                self._http = http.client.HTTPConnection(self.host, self.port, timeout=15)
            try:
                self._http.request(
                    "POST",
                    f"/scheduler/{verb}",
                    body=json.dumps(body),
                    headers={"Content-Type": "application/json"},
                )
                response = self._http.getresponse()
                return json.loads(response.read() or b"null")
            except (OSError, http.client.HTTPException):
                self._http.close()
                self._http = None
                if attempt:
                    raise
        return None

    def schedule(self, pod: dict[str, Any], names: list[str]) -> str | None:
        """filter -> prioritize -> bind, as kube-scheduler does; the node, or None."""
        meta = pod["metadata"]
        result = self._post("filter", {"Pod": pod, "Nodes": None, "NodeNames": names})
        feasible = (result or {}).get("NodeNames") or []
        if not feasible:
            return None
        scores = self._post("prioritize", {"Pod": pod, "Nodes": None, "NodeNames": feasible})
        ranked = sorted(scores or [], key=lambda h: -int(h.get("Score", 0)))
        node = ranked[0]["Host"] if ranked else feasible[0]
        answer = self._post(
            "bind",
            {"PodName": meta["name"], "PodNamespace": meta["namespace"],
             "PodUID": meta["uid"], "Node": node},
        )  # fmt: skip
        return node if answer == {"Error": ""} else None

    # --- users and kubelet ----------------------------------------------------------------------

    def _new_pod(self) -> dict[str, Any]:
        namespace, image, gpus, mem, pct, cores, life = self.rng.choice(CATALOGUE)
        self.serial += 1
        limits: dict[str, Any] = {"nvidia.com/gpu": str(gpus), "nvidia.com/gpucores": str(cores)}
        if mem is not None:
            limits["nvidia.com/gpumem"] = str(mem)
        if pct is not None:
            limits["nvidia.com/gpumem-percentage"] = str(pct)
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{image}-{self.serial:05d}",
                "namespace": namespace,
                "labels": {"app": image, "tessera.io/demo": "true"},
            },
            "spec": {
                "schedulerName": "tessera-scheduler",
                "containers": [
                    {"name": image, "image": f"demo/{image}:1", "resources": {"limits": limits}}
                ],
            },
        }
        created = self.kube.create_pod(pod)
        meta = created["metadata"]
        self.pods[meta["uid"]] = DemoPod(
            meta["namespace"], meta["name"], meta["uid"], time.monotonic() + self.rng.uniform(*life)
        )
        return created

    def _end(self, pod: DemoPod, why: str) -> None:
        self.kube.delete_pod(pod.namespace, pod.name)
        bindings.release_binding(pod.uid, why)
        self.pods.pop(pod.uid, None)

    def tick(self) -> dict[str, int]:
        """One round: end what is due, create arrivals, schedule every pending pod."""
        now = time.monotonic()
        stats = {"arrived": 0, "bound": 0, "pending": 0, "ended": 0, "gave_up": 0}
        for pod in list(self.pods.values()):
            if pod.node and pod.ends_at <= now:
                self._end(pod, "pod completed (demo)")
                stats["ended"] += 1
        for _ in range(self.rng.randint(*self.arrivals)):
            self._new_pod()
            stats["arrived"] += 1
        names = list(Node.objects.order_by("name").values_list("name", flat=True))
        for pod in [p for p in self.pods.values() if not p.node]:
            obj = self.kube.get_pod(pod.namespace, pod.name)
            if obj is None:
                self.pods.pop(pod.uid, None)
                continue
            node = self.schedule(obj, names)
            if node:
                pod.node = node
                self.kube.set_phase(pod.namespace, pod.name, "Running")
                stats["bound"] += 1
            else:
                pod.tries += 1
                if pod.tries > MAX_PENDING_TICKS:  # the user gives up and deletes it
                    self._end(pod, "pod deleted while pending (demo)")
                    stats["gave_up"] += 1
                else:
                    stats["pending"] += 1
        return stats

    def adopt(self) -> int:
        """Take over demo pods a previous run left behind (they end like new ones)."""
        for pod in self.kube.list_pods():
            meta = pod.get("metadata") or {}
            if (meta.get("labels") or {}).get("tessera.io/demo") != "true":
                continue
            self.pods[meta["uid"]] = DemoPod(
                meta["namespace"],
                meta["name"],
                meta["uid"],
                time.monotonic() + self.rng.uniform(5, 60),
                (pod.get("spec") or {}).get("nodeName") or "",
            )
        self.serial = max(self.serial, len(self.pods)) + int(time.time()) % 100000
        return len(self.pods)

    def run(self, *, interval: float, ticks: int = 0) -> None:
        """Tick until stopped (Ctrl-C / SIGTERM) or `ticks` ticks have run."""
        self._wait_ready()
        adopted = self.adopt()
        if adopted:
            self.log(f"demo workload: took over {adopted} pods of an earlier run")
        self.log(f"demo workload: scheduling through http://{self.host}:{self.port}/scheduler/")
        done, last_report = 0, 0.0
        try:
            while not ticks or done < ticks:
                if time.monotonic() - last_report > 30:
                    self.report()  # the demo nodes' heartbeat, as their plugins would send
                    last_report = time.monotonic()
                try:
                    stats = self.tick()
                except (OSError, KubeError, http.client.HTTPException) as exc:
                    self.log(f"demo workload: tick failed ({exc}); retrying")
                    stats = None
                if stats and any(stats.values()):
                    running = sum(1 for p in self.pods.values() if p.node)
                    self.log(
                        "demo workload: " + ", ".join(f"{k} {v}" for k, v in stats.items() if v)
                        + f"; running {running}"
                    )  # fmt: skip
                done += 1
                if not ticks or done < ticks:
                    time.sleep(interval)
        finally:
            connections.close_all()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                c = http.client.HTTPConnection(self.host, self.port, timeout=2)
                c.request("GET", "/healthz")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"no control plane answering at {self.host}:{self.port}")
            time.sleep(0.5)
