"""Chaos: thousands of GPU pods through a real cluster while its parts crash and restart.

    .venv/bin/python -m e2e.chaos [--pods 2000] [--seed N] [--rate 15]     (make chaos PODS= SEED=)

One harness cluster (e2e/cluster.py): etcd, kube-apiserver, kube-scheduler, kwok GPU nodes, two
control-plane replicas (each a REST API and a webhook listener, sharing their ports like pods
behind a Service), the extender sidecar, a Celery worker and a Celery beat; the control plane on
a PostgreSQL and a Redis of the run's own (e2e/services.py), so restarting them disturbs nothing
else. Then, everything drawn from one random generator seeded with `--seed` (printed; the same
seed plays the same pods, deletions and faults again):

- pods: `--pods` GPU pods created at a steady `--rate`, of mixed slice sizes (SHAPES); a few ask
  for a small pool of nodes that holds only some of them, so the rest stay pending; some are
  deleted a little after their creation, bound or not;
- faults, at random moments of the run: kill -9 of the extender sidecar, of a control-plane
  replica, of the Celery worker, of the Celery beat and of kube-scheduler, each started again a
  moment later (as a Deployment would), one after another; PostgreSQL, Redis and kube-apiserver
  stopped and started again on the same data, one after another, overlapping the kills.

A supervisor starts again any part that exits by itself, and reports it as a failure.

While it runs, a sampler reads the ledger over SQL every second (over-allocated cards,
reservations left past their deadline after a reconcile pass that should have settled them,
bindings on two nodes) and checks the API server's view of the bound pods, kept by a watch,
against the cards' capacity. After the last fault the run waits until the cluster has settled,
then for the reconciler's next full pass, and checks that every pod is bound exactly once or
pending with a "why", that no card was ever over-allocated, that the ledger equals the API
server, and that no reservation outlived its deadline (docs/e2e.md, "Chaos").
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import requests

# Run as a script (`python e2e/chaos.py`), this file finds its sibling modules from the
# checkout's root, as `python -m e2e.chaos` does.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from e2e import objects
from e2e.cluster import Cluster, Options
from e2e.harness import HarnessError, run_folder
from e2e.processes import ended
from e2e.services import Services

CARD_MEMORY_MIB = 81920
CARD_CORES = 100
CARD_SLOTS = 10
CARDS_PER_NODE = 8
SCARCE_NODES = 2  # the small pool: two nodes of two cards, one scarce pod per card
SCARCE_CARDS = 2
NAMESPACES = 4
REPLICAS = 2
LABEL = "tessera.io/chaos"
ALLOCATION = "tessera.io/allocation"
DELETE_SHARE = 0.15
PODS_PER_ROUND = 700  # a round of faults (every kind once) per this many pods, or part of it
# Room in the shared pool for about this many cards per pod created: ~0.3 of a card is what the
# shapes below ask on average, so most pods fit, with the pool's nodes filling up one by one
# (binpack) and binds racing for the last room on them.
CARDS_PER_POD = 0.32

# The control plane's settings for the run: a reconcile pass every 3 s, a full relist every 15 s
# (the checks wait for one), reservations that expire after 30 s, and a lock that a killed worker
# leaves for at most 20 s.
CONTROLPLANE_ENV = {
    "TESSERA_RECONCILE_PERIOD_S": "3",
    "TESSERA_FULL_RESYNC_S": "15",
    "TESSERA_RESERVATION_TIMEOUT_S": "30",
    "TESSERA_RECONCILE_LOCK_TTL_S": "20",
}

KILLS = ("extender", "replica", "worker", "beat", "kube-scheduler")
RESTARTS = ("postgresql", "redis", "kube-apiserver")


@dataclass(frozen=True, slots=True)
class Shape:
    """What a pod asks for: `gpus` slices of `gpumem` MiB (None: a whole card) and `cores` %."""

    name: str
    weight: int
    gpus: int
    gpumem: int | None
    cores: int | None
    pool: str = "shared"


SHAPES = (
    Shape("small", 30, 1, 8192, 10),
    Shape("medium", 30, 1, 20480, 25),
    Shape("large", 15, 1, 40960, 50),
    Shape("pair", 12, 2, 12288, 20),
    Shape("whole", 5, 1, None, None),
    Shape("scarce", 3, 1, 61440, 50, pool="scarce"),
)


@dataclass(frozen=True, slots=True)
class PodPlan:
    name: str
    namespace: str
    shape: Shape
    at: float  # seconds from the start of the workload
    delete_at: float | None  # when it is deleted (None: never)


@dataclass(frozen=True, slots=True)
class Fault:
    at: float  # seconds from the start of the workload
    kind: str  # one of KILLS or RESTARTS
    replica: int  # the control-plane replica ("replica" only)
    pause_s: float  # how long the component stays down


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything the seed decides."""

    seed: int
    pods: tuple[PodPlan, ...]
    faults: tuple[Fault, ...]
    nodes: int  # of the shared pool
    window_s: float  # the workload's length


def make_plan(seed: int, pods: int, rate: float, rounds: int) -> Plan:
    """The run's pods, deletions and faults, from `seed` alone. Each round of faults is every
    kind once, each at a moment of its own between the workload's first twentieth and its last
    tenth."""
    rng = random.Random(seed)
    window = pods / rate
    weights = [s.weight for s in SHAPES]
    plans = []
    for i in range(pods):
        shape = rng.choices(SHAPES, weights)[0]
        at = i / rate
        delete_at = None
        if rng.random() < DELETE_SHARE:
            delete_at = min(at + rng.uniform(1.0, 30.0), window + 5.0)
        plans.append(PodPlan(f"p-{i:05d}", f"chaos-{i % NAMESPACES}", shape, at, delete_at))
    faults = []
    for _ in range(rounds):
        for kind in (*KILLS, *RESTARTS):
            at = rng.uniform(0.05, 0.9) * window
            pause = rng.uniform(1.0, 4.0) if kind in RESTARTS else rng.uniform(0.2, 2.0)
            faults.append(Fault(at, kind, rng.randint(1, REPLICAS), pause))
    nodes = max(4, math.ceil(pods * CARDS_PER_POD / CARDS_PER_NODE))
    return Plan(seed, tuple(plans), tuple(sorted(faults, key=lambda f: f.at)), nodes, window)


def pod_manifest(plan: PodPlan) -> dict[str, Any]:
    shape = plan.shape
    pod = objects.gpu_pod(
        plan.name,
        gpus=shape.gpus,
        gpumem=shape.gpumem,
        gpucores=shape.cores,
        pool=shape.pool,
        labels={LABEL: shape.name},
    )
    pod["metadata"]["namespace"] = plan.namespace
    return pod


# --- what the API server says ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodView:
    """A pod as the API server has it, reduced to what the checks read."""

    uid: str
    namespace: str
    name: str
    node: str
    phase: str
    allocation: str  # the raw tessera.io/allocation annotation ("" when none)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def bound(self) -> bool:
        return bool(self.node) and self.phase not in ("Succeeded", "Failed")

    def devices(self) -> list[tuple[str, int, int]]:
        """(card UUID, MiB, cores %) of each slice its allocation names."""
        if not self.allocation:
            return []
        record = json.loads(self.allocation)
        return [
            (d["uuid"], int(d["memory_mib"]), int(d["cores"]))
            for c in record.get("containers", [])
            for d in c.get("devices", [])
        ]


def pod_view(raw: dict[str, Any]) -> PodView:
    meta, spec = raw.get("metadata") or {}, raw.get("spec") or {}
    return PodView(
        uid=str(meta.get("uid", "")),
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        node=str(spec.get("nodeName") or ""),
        phase=str((raw.get("status") or {}).get("phase") or ""),
        allocation=str((meta.get("annotations") or {}).get(ALLOCATION, "")),
    )


def list_pods(api: objects.Api) -> tuple[dict[str, PodView], str]:
    """Every pod of the run (uid -> view) in pages, and the list's resourceVersion."""
    pods: dict[str, PodView] = {}
    token = ""
    while True:
        path = f"/api/v1/pods?labelSelector={LABEL}&limit=500"
        page = api.get(path + (f"&continue={token}" if token else ""))
        for raw in page.get("items") or []:
            view = pod_view(raw)
            pods[view.uid] = view
        token = (page.get("metadata") or {}).get("continue") or ""
        if not token:
            return pods, str(page["metadata"]["resourceVersion"])


class Mirror:
    """The API server's view of the run's pods: a list, then a watch from its version; a broken
    watch (the API server restarting) is followed by a new list. Every node and allocation a pod
    was ever seen with is kept: a pod seen on two nodes, or with two allocations, was bound
    twice."""

    def __init__(self, api: objects.Api) -> None:
        self.api = api
        self.lock = threading.Lock()
        self.pods: dict[str, PodView] = {}
        self.nodes_seen: dict[str, set[str]] = defaultdict(set)
        self.allocations_seen: dict[str, set[str]] = defaultdict(set)
        self.keys: dict[str, str] = {}
        self.relists = 0
        self.synced = threading.Event()

    def see(self, view: PodView) -> None:
        self.keys[view.uid] = view.key
        if view.node:
            self.nodes_seen[view.uid].add(view.node)
        if view.allocation:
            self.allocations_seen[view.uid].add(view.allocation)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                pods, version = list_pods(self.api)
                with self.lock:
                    self.pods = pods
                    for view in pods.values():
                        self.see(view)
                self.relists += 1
                self.synced.set()
                self._watch(version, stop)
            except (requests.RequestException, ValueError, KeyError):
                pass  # the API server is away: list again in a moment
            stop.wait(0.5)

    def _watch(self, version: str, stop: threading.Event) -> None:
        path = (
            f"/api/v1/pods?watch=true&labelSelector={LABEL}&resourceVersion={version}"
            "&allowWatchBookmarks=true&timeoutSeconds=60"
        )
        for event in self.api.events(path, stop, timeout=(5, 90)):
            kind, raw = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                return  # e.g. 410 Gone: list again
            if kind == "BOOKMARK":
                continue
            view = pod_view(raw)
            with self.lock:
                if kind == "DELETED":
                    self.pods.pop(view.uid, None)
                else:
                    self.pods[view.uid] = view
                self.see(view)

    def snapshot(self) -> dict[str, PodView]:
        with self.lock:
            return dict(self.pods)

    def twice_bound(self) -> list[str]:
        """Pods seen on more than one node or with more than one allocation."""
        with self.lock:
            return sorted(
                f"{self.keys[uid]} (uid {uid}): nodes {sorted(self.nodes_seen[uid])}, "
                f"{len(self.allocations_seen[uid])} allocations"
                for uid in set(self.nodes_seen) | set(self.allocations_seen)
                if len(self.nodes_seen[uid]) > 1 or len(self.allocations_seen[uid]) > 1
            )


def over_allocated(usage: Iterable[tuple[str, int, int, int]]) -> list[str]:
    """Cards over their capacity, from (card UUID, MiB, cores %, slices) totals."""
    return [
        f"{uuid}: {memory} MiB of {CARD_MEMORY_MIB}, {cores}% of {CARD_CORES}, "
        f"{slices} slices of {CARD_SLOTS}"
        for uuid, memory, cores, slices in usage
        if memory > CARD_MEMORY_MIB or cores > CARD_CORES or slices > CARD_SLOTS
    ]


def api_usage(pods: Iterable[PodView]) -> list[tuple[str, int, int, int]]:
    """Per card, what the API server's bound pods hold by their allocations."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for pod in pods:
        if pod.bound:
            for uuid, memory, cores in pod.devices():
                total = totals[uuid]
                total[0], total[1], total[2] = total[0] + memory, total[1] + cores, total[2] + 1
    return [(uuid, memory, cores, n) for uuid, (memory, cores, n) in totals.items()]


# --- what the ledger says (SQL, the control plane's own PostgreSQL) -----------------------------

ACTIVE = ("reserved", "bound", "allocated")

CARD_USAGE_SQL = """
SELECT c.uuid, SUM(s.memory_mib), SUM(s.compute_percent), COUNT(*)
FROM ledger_slice s JOIN ledger_card c ON c.id = s.card_id
WHERE s.active GROUP BY c.uuid
"""
# Bindings whose active slices lie on a card of another node, or that hold active slices while
# not active themselves; pod names with two active bindings.
TWICE_SQL = """
SELECT b.namespace || '/' || b.name || ' (uid ' || b.pod_uid || '): ' || b.phase
       || ' on ' || COALESCE(n.name, '-') || ', a slice on ' || c.uuid
FROM ledger_slice s JOIN ledger_podbinding b ON b.id = s.binding_id
JOIN ledger_card c ON c.id = s.card_id LEFT JOIN ledger_node n ON n.id = b.node_id
WHERE s.active AND (c.node_id IS DISTINCT FROM b.node_id
                    OR b.phase NOT IN ('reserved', 'bound', 'allocated'))
UNION ALL
SELECT namespace || '/' || name || ': ' || COUNT(*) || ' active bindings'
FROM ledger_podbinding WHERE phase IN ('reserved', 'bound', 'allocated')
GROUP BY namespace, name HAVING COUNT(*) > 1
"""
# Reservations whose deadline had passed when the latest finished reconcile pass began: that
# pass looked at them (a watch pass looks up every expired reservation's pod, a full one lists
# them all), so they should be bound or failed by now.
STUCK_SQL = """
SELECT b.namespace || '/' || b.name || ': reserved on ' || COALESCE(n.name, '-')
       || ', deadline ' || to_char(b.deadline, 'HH24:MI:SS.MS')
       || ', pass started ' || to_char(r.started, 'HH24:MI:SS.MS')
FROM ledger_podbinding b LEFT JOIN ledger_node n ON n.id = b.node_id,
     (SELECT MAX(started_at) AS started FROM reconciler_reconcilerun
      WHERE finished_at IS NOT NULL) r
WHERE b.phase = 'reserved' AND b.deadline < r.started
"""
BINDINGS_SQL = """
SELECT b.pod_uid, b.namespace, b.name, b.phase, COALESCE(n.name, ''),
       COALESCE(json_agg(json_build_array(c.uuid, s.memory_mib, s.compute_percent))
                FILTER (WHERE s.active), '[]')
FROM ledger_podbinding b LEFT JOIN ledger_node n ON n.id = b.node_id
LEFT JOIN ledger_slice s ON s.binding_id = b.id LEFT JOIN ledger_card c ON c.id = s.card_id
GROUP BY b.id, n.name
"""
# Reservations still held this long after their deadline, whatever the reconciler did: it runs
# every 3 s, a worker killed mid-pass leaves its lock for 20 s, and the API server or the
# database may be away for a restart meanwhile; past that, nothing is settling them.
LATE_S = 60
LATE_SQL = """
SELECT b.namespace || '/' || b.name || ': reserved on ' || COALESCE(n.name, '-')
       || ', deadline ' || to_char(b.deadline, 'HH24:MI:SS.MS')
FROM ledger_podbinding b LEFT JOIN ledger_node n ON n.id = b.node_id
WHERE b.phase = 'reserved' AND b.deadline < now() - make_interval(secs => %s)
"""
LAST_FULL_SQL = """
SELECT MAX(started_at) FROM reconciler_reconcilerun
WHERE mode = 'full' AND finished_at IS NOT NULL AND started_at > %s
"""


@dataclass(frozen=True, slots=True)
class BindingView:
    uid: str
    key: str
    phase: str
    node: str
    slices: tuple[tuple[str, int, int], ...]  # active ones: (card UUID, MiB, cores %)

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE


def compare(pods: dict[str, PodView], ledger: dict[str, BindingView]) -> list[str]:
    """Where the ledger and the API server disagree, pod by pod."""
    problems = []
    for uid, binding in ledger.items():
        pod = pods.get(uid)
        if not binding.active:
            if binding.slices:
                problems.append(f"{binding.key}: {binding.phase} but holds active slices")
            continue
        if pod is None:
            problems.append(f"{binding.key}: {binding.phase} in the ledger, pod gone")
        elif not pod.bound:
            problems.append(f"{binding.key}: {binding.phase} on {binding.node}, pod unbound")
        elif pod.node != binding.node:
            problems.append(f"{binding.key}: ledger node {binding.node}, pod on {pod.node}")
        elif binding.phase == "reserved":
            problems.append(f"{binding.key}: bound, still reserved in the ledger")
        elif sorted(pod.devices()) != sorted(binding.slices):
            problems.append(
                f"{binding.key}: allocation {sorted(pod.devices())} != ledger "
                f"{sorted(binding.slices)}"
            )
    for uid, pod in pods.items():
        held = ledger.get(uid)
        if pod.bound and (held is None or not held.active):
            state = held.phase if held is not None else "no binding"
            problems.append(f"{pod.key}: bound to {pod.node}, ledger: {state}")
    return problems


class Ledger:
    """Reads of the ledger over SQL; one connection, opened again after PostgreSQL restarts."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: Any = None

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=3)
        try:
            return list(self._conn.execute(sql, args or None).fetchall())
        except psycopg.Error:
            self._conn.close()
            raise

    def bindings(self) -> dict[str, BindingView]:
        found = {}
        for uid, namespace, name, phase, node, slices in self.query(BINDINGS_SQL):
            found[uid] = BindingView(
                uid, f"{namespace}/{name}", phase, node, tuple(sorted(map(tuple, slices)))
            )
        return found

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Created:
    """One planned pod's fate."""

    plan: PodPlan
    uid: str = ""
    attempts: int = 0
    refused: str = ""  # the API server's refusal, when it never let the pod in
    deleted: bool = False
    delete_attempts: int = 0


@dataclass
class Event:
    at: float  # seconds from the start of the workload
    what: str


@dataclass
class Samples:
    """What the sampler saw, sample by sample."""

    taken: int = 0
    missed: int = 0  # the database was away
    ledger_over: int = 0  # samples with an over-allocated card in the ledger
    api_over: int = 0  # ... in the API server's bound pods
    stuck: int = 0  # samples with a reservation past its deadline after a pass
    late: int = 0  # samples with a reservation LATE_S past its deadline
    twice: int = 0  # samples with a binding on two nodes
    examples: dict[str, list[str]] = field(default_factory=dict)

    def note(self, kind: str, at: float, found: list[str]) -> None:
        if found:
            setattr(self, kind, getattr(self, kind) + 1)
            seen = self.examples.setdefault(kind, [])
            if len(seen) < 10:
                seen.append(f"+{at:.1f} s: {'; '.join(found[:5])}")


@dataclass
class Report:
    seed: int
    planned: int
    nodes: int
    events: list[Event] = field(default_factory=list)
    kills: Counter[str] = field(default_factory=Counter)
    restarts: Counter[str] = field(default_factory=Counter)
    created: int = 0
    refused: list[str] = field(default_factory=list)
    create_retries: int = 0
    deleted: int = 0
    bound: int = 0
    pending_why: Counter[str] = field(default_factory=Counter)  # outcome -> pods
    lost: list[str] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # ledger != API server after the pass
    final_over: list[str] = field(default_factory=list)
    final_stuck: list[str] = field(default_factory=list)
    samples: Samples = field(default_factory=Samples)
    converge_s: float | None = None  # after the last fault's component was back
    settle_s: float | None = None  # after the workload's last create or delete
    unsettled: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)  # parts that exited by themselves
    timings: dict[str, float] = field(default_factory=dict)

    def violations(self) -> list[str]:
        """Every failed check, each naming its pods or cards."""
        found = []
        checks: list[tuple[str, list[str]]] = [
            ("pods refused at creation", self.refused),
            ("pods lost (bound without a ledger binding, or pending without a why)", self.lost),
            ("pods bound twice", self.doubled),
            ("ledger and API server differ after the reconciler's full pass", self.mismatched),
            ("cards over-allocated after the run", self.final_over),
            ("reservations left past their deadline after the run", self.final_stuck),
            ("the cluster never settled", self.unsettled),
            ("parts that exited by themselves (each started again)", self.crashed),
        ]
        for title, items in checks:
            if items:
                found.append(f"{title} ({len(items)}): " + "; ".join(items[:20]))
        read = self.samples.taken - self.samples.missed
        if read < self.samples.taken / 2:
            found.append(
                f"the sampler read the ledger in only {read} of {self.samples.taken} samples: "
                "the run checked too little"
            )
        for kind, title in (
            ("ledger_over", "samples with a card over-allocated in the ledger"),
            ("api_over", "samples with a card over-allocated by the API server's bound pods"),
            ("stuck", "samples with a reservation past its deadline after a reconcile pass"),
            ("late", f"samples with a reservation over {LATE_S} s past its deadline"),
            ("twice", "samples with a binding on two nodes"),
        ):
            count = getattr(self.samples, kind)
            if count:
                found.append(f"{title}: {count}: " + " | ".join(self.samples.examples[kind]))
        return found

    def render(self) -> str:
        lines = [f"chaos: seed {self.seed} (reproduce: make chaos SEED={self.seed} "
                 f"PODS={self.planned})", "events (seconds from the first pod):"]  # fmt: skip
        lines += [f"  +{e.at:6.1f} s  {e.what}" for e in sorted(self.events, key=lambda e: e.at)]
        pending = sum(self.pending_why.values())
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(self.pending_why.items())) or "-"
        lines += [
            f"pods: {self.planned} planned on {self.nodes} + {SCARCE_NODES} nodes, "
            f"{self.created} created ({self.create_retries} create retries), "
            f"{len(self.refused)} refused, {self.deleted} deleted, {self.bound} bound, "
            f"{pending} pending with a why ({outcomes})",
            "kills (kill -9, then started again): "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.kills.items())) or "none"),
            "restarts (stopped, then started on the same data): "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items())) or "none"),
            f"lost {len(self.lost)}, doubled {len(self.doubled)}, ledger/API mismatches "
            f"{len(self.mismatched)}",
            f"samples: {self.samples.taken} taken ({self.samples.missed} while the database was "
            f"away); over-allocated: ledger {self.samples.ledger_over}, API server "
            f"{self.samples.api_over}; reservations past their deadline after a pass "
            f"{self.samples.stuck}, over {LATE_S} s past it {self.samples.late}; bindings on two "
            f"nodes {self.samples.twice}",
            f"parts that exited by themselves: {len(self.crashed)}",
            "converged "
            + (
                f"{self.converge_s:.1f} s after the last fault ({self.settle_s:.1f} s after the "
                "last create or delete)"
                if self.converge_s is not None and self.settle_s is not None
                else "never"
            ),
            "timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items()),
        ]
        return "\n".join(lines)


class Chaos:
    """One chaos run on a cluster that is up, with its nodes registered."""

    def __init__(
        self, cluster: Cluster, services: Services, plan: Plan, report: Report, rate: float
    ) -> None:
        self.cluster, self.services, self.plan, self.report = cluster, services, plan, report
        self.rate = rate
        self.api = objects.Api(cluster)
        self.tessera = objects.Tessera(cluster.controlplane_url, cluster.admin_token)
        self.mirror = Mirror(self.api)
        self.ledger = Ledger(services.database_url)
        self.pods = {p.name: Created(p) for p in plan.pods}
        self.start = 0.0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.last_fault_done = 0.0
        self.workload_done = 0.0
        # The parts that faults under way have taken down (the supervisor leaves them alone),
        # changed under `gate`.
        self.gate = threading.Lock()
        self.down: Counter[str] = Counter()

    def now(self) -> float:
        return time.monotonic() - self.start

    def event(self, what: str, at: float | None = None) -> None:
        """Note what happened `at` (seconds from the start; default: now)."""
        at = self.now() if at is None else at
        with self.lock:
            self.report.events.append(Event(at, what))
        print(f"chaos: +{at:6.1f} s  {what}", flush=True)

    # -- pods ------------------------------------------------------------------------------------
    def create(self, created: Created) -> None:
        plan = created.plan
        path = f"/api/v1/namespaces/{plan.namespace}/pods"
        body = pod_manifest(plan)
        deadline = time.monotonic() + 180
        while True:
            created.attempts += 1
            try:
                resp = self.api.session().post(f"{self.api.base}{path}", json=body, timeout=15)
            except requests.RequestException:
                resp = None
            if resp is not None and resp.status_code == 201:
                created.uid = resp.json()["metadata"]["uid"]
                return
            if resp is not None and resp.status_code == 409:  # an earlier attempt got through
                pod = self.api.get(f"{path}/{plan.name}")
                created.uid = pod["metadata"]["uid"]
                return
            if resp is not None and resp.status_code in (400, 403, 422):
                created.refused = f"{plan.namespace}/{plan.name}: {resp.text[:300]}"
                return
            if time.monotonic() > deadline:
                status = resp.status_code if resp is not None else "no answer"
                created.refused = f"{plan.namespace}/{plan.name}: still failing ({status})"
                return
            time.sleep(min(2.0, 0.1 * 2 ** min(created.attempts, 5)) * random.random())

    def delete(self, created: Created) -> None:
        plan = created.plan
        url = f"{self.api.base}/api/v1/namespaces/{plan.namespace}/pods/{plan.name}"
        while not self.stop.is_set():
            created.delete_attempts += 1
            try:
                resp = self.api.session().delete(
                    url, params={"gracePeriodSeconds": "0"}, timeout=15
                )
                if resp.status_code in (200, 202, 404):
                    created.deleted = True
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)

    def workload(self) -> None:
        """Create every pod at its moment and delete the planned ones at theirs."""
        steps: list[tuple[float, int, str, Created]] = []
        for created in self.pods.values():
            steps.append((created.plan.at, 0, "create", created))
            if created.plan.delete_at is not None:
                steps.append((created.plan.delete_at, 1, "delete", created))
        steps.sort(key=lambda s: (s[0], s[1]))
        futures: dict[str, Any] = {}
        with ThreadPoolExecutor(24) as pool:
            for at, _, action, created in steps:
                time.sleep(max(0.0, self.start + at - time.monotonic()))
                if action == "create":
                    futures[created.plan.name] = pool.submit(self.create, created)
                else:
                    made = futures[created.plan.name]

                    def deletion(c: Created = created, f: Any = made) -> None:
                        f.result()  # after its create, whenever that got through
                        if c.uid:
                            self.delete(c)

                    pool.submit(deletion)
        self.workload_done = self.now()
        self.event("workload done: every pod created, every planned deletion made")

    # -- faults ----------------------------------------------------------------------------------
    def inject(self, kinds: tuple[str, ...]) -> None:
        """One lane of faults: those of `kinds`, one after another, each at its moment or as
        soon as the one before is over. The two lanes (kills, restarts) overlap."""
        for fault in (f for f in self.plan.faults if f.kind in kinds):
            self.stop.wait(max(0.0, self.start + fault.at - time.monotonic()))
            if self.stop.is_set():
                return
            parts = self.parts(fault)
            with self.gate:
                self.down.update(parts)
            try:
                self.fault(fault)
            except HarnessError as exc:
                self.event(f"FAULT FAILED: {fault.kind}: {exc}")
                self.report.unsettled.append(f"{fault.kind} did not come back: {exc}")
                return
            finally:
                with self.gate:
                    self.down.subtract(parts)
            self.last_fault_done = max(self.last_fault_done, self.now())

    def parts(self, fault: Fault) -> tuple[str, ...]:
        """The components (or servers) a fault takes down."""
        if fault.kind == "replica":
            return self.cluster.replica_components(fault.replica)
        return {
            "worker": ("celery-worker",),
            "beat": ("celery-beat",),
            "postgresql": ("postgres",),
        }.get(fault.kind, (fault.kind,))

    def fault(self, fault: Fault) -> None:
        cluster, kind, pause = self.cluster, fault.kind, fault.pause_s
        began = self.now()
        if kind in RESTARTS:
            if kind == "kube-apiserver":
                pid = cluster.state["components"]["kube-apiserver"]["pid"]
                # It stops listening at once, then may linger in its shutdown for longer than
                # the run can wait; a kubelet would kill it after its grace period too.
                cluster.stop_component("kube-apiserver", timeout_s=3.0)
            else:
                pid = self.services.stop(self.parts(fault)[0])
            stopped = self.now()
            time.sleep(pause)
            if kind == "kube-apiserver":
                cluster.start_apiserver()
            else:
                self.services.start(self.parts(fault)[0])
            self.report.restarts[kind] += 1
            self.event(
                f"restart {kind} (pid {pid}): stopped in {stopped - began:.1f} s, down "
                f"{pause:.1f} s, up again in {self.now() - stopped - pause:.1f} s",
                at=began,
            )
            return
        names = self.parts(fault)
        what = f"control-plane replica {fault.replica}" if kind == "replica" else kind
        pids = [cluster.kill_component(name) for name in names]
        time.sleep(pause)
        restarted = self.now()
        if kind == "replica":
            cluster.start_replica(fault.replica)  # both of its listeners
        elif kind == "extender":
            cluster.start_extender()
        elif kind == "kube-scheduler":
            cluster.start_scheduler()
        else:
            cluster.start_celery(names[0], cluster.celery_args(kind))
        self.report.kills[kind] += 1
        self.event(
            f"kill -9 {what} (pid {', '.join(map(str, pids))}); started again after "
            f"{pause:.1f} s, ready in {self.now() - restarted:.1f} s",
            at=began,
        )

    # -- the sampler -----------------------------------------------------------------------------
    def sample(self) -> None:
        try:
            self._sample()
        except Exception as exc:  # a check that cannot run is a failed check
            self.report.unsettled.append(f"the sampler stopped: {type(exc).__name__}: {exc}")
            raise

    def _sample(self) -> None:
        samples = self.report.samples
        while not self.stop.wait(1.0):
            at = self.now()
            samples.taken += 1
            pods = self.mirror.snapshot() if self.mirror.synced.is_set() else {}
            samples.note("api_over", at, over_allocated(api_usage(pods.values())))
            try:
                usage = self.card_usage()
                twice = [row[0] for row in self.ledger.query(TWICE_SQL)]
                stuck = [row[0] for row in self.ledger.query(STUCK_SQL)]
                late = [row[0] for row in self.ledger.query(LATE_SQL, LATE_S)]
            except psycopg.OperationalError:  # PostgreSQL is restarting
                samples.missed += 1
                continue
            samples.note("ledger_over", at, over_allocated(usage))
            samples.note("twice", at, twice)
            samples.note("stuck", at, stuck)
            samples.note("late", at, late)

    def supervise(self) -> None:
        """As a Deployment would: start again any part that exited without being killed by
        the run (and report it: a part that dies by itself is a failure of its own)."""
        while not self.stop.wait(1.0):
            with self.gate:  # no fault starts meanwhile
                try:
                    dead = [name for name, up in self.cluster.alive().items() if not up]
                    dead += [s for s, pid in list(self.services.pids.items()) if ended(pid)]
                    for name in (n for n in dead if not self.down[n]):
                        self.event(f"CRASHED: {name} exited by itself; starting it again")
                        self.report.crashed.append(f"{name} at +{self.now():.1f} s")
                        self.revive(name)
                except HarnessError as exc:
                    self.event(f"could not start a crashed part again: {exc}")

    def revive(self, name: str) -> None:
        cluster = self.cluster
        if name in self.services.pids:
            self.services.pids.pop(name)
            self.services.start(name)
        elif name == "extender":
            cluster.start_extender()
        elif name.startswith("celery-"):
            cluster.start_celery(name, cluster.celery_args(name.removeprefix("celery-")))
        elif name == "kube-scheduler":
            cluster.start_scheduler()
        elif name == "kube-apiserver":
            cluster.kill_component(name)
            cluster.start_apiserver()
        else:
            replica = next(
                (r for r in range(1, REPLICAS + 1) if name in cluster.replica_components(r)), 0
            )
            if not replica:
                raise HarnessError(f"{name} exited, and the run does not start it again")
            for part in cluster.replica_components(replica):
                cluster.kill_component(part)
            cluster.start_replica(replica)

    def progress(self) -> str:
        pods = self.mirror.snapshot()
        created = sum(1 for c in self.pods.values() if c.uid)
        bound = sum(1 for p in pods.values() if p.bound)
        s = self.report.samples
        return (
            f"created {created}/{len(self.pods)}, in the API server {len(pods)} ({bound} bound), "
            f"samples {s.taken} (over-allocated {s.ledger_over}+{s.api_over}, stuck {s.stuck})"
        )

    def card_usage(self) -> list[tuple[str, int, int, int]]:
        """Per card, the ledger's active slices: (UUID, MiB, cores %, slices)."""
        rows = self.ledger.query(CARD_USAGE_SQL)
        return [(uuid, int(mib), int(cores), int(n)) for uuid, mib, cores, n in rows]

    # -- settling and the checks -----------------------------------------------------------------
    def why(self, pod: PodView) -> str:
        """The "why" answer's outcome for a pending pod ("" when there is none)."""
        try:
            resp = self.tessera.why(pod.namespace, pod.name)
        except requests.RequestException:
            return ""
        if resp.status_code != 200:
            return ""
        answer = resp.json()
        if answer.get("pod_uid") != pod.uid or not answer.get("summary"):
            return ""
        return str(answer.get("outcome", ""))

    def unsettled(self) -> list[str]:
        """What keeps the cluster from having settled: ledger/API differences, deleted pods
        still there, pods not yet in the API server. Empty: settled."""
        pods, _ = list_pods(self.api)
        problems = compare(pods, self.ledger.bindings())
        present = {p.key for p in pods.values()}
        for created in self.pods.values():
            key = f"{created.plan.namespace}/{created.plan.name}"
            if created.deleted and key in present:
                problems.append(f"{key}: deleted, still in the API server")
            elif created.uid and not created.deleted and created.uid not in pods:
                problems.append(f"{key}: created (uid {created.uid}), gone from the API server")
        if problems:
            return problems
        return [
            f"{p.key}: pending, no why" for p in pods.values() if not p.bound and not self.why(p)
        ]

    def settle(self, timeout_s: float) -> None:
        """Wait until the cluster has settled after the last fault and the last pod."""
        deadline = time.monotonic() + timeout_s
        problems = ["not looked yet"]
        while time.monotonic() < deadline:
            try:
                problems = self.unsettled()
            except (requests.RequestException, OSError) as exc:
                problems = [f"cannot read the cluster: {exc}"]
            if not problems:
                now = self.now()
                self.report.converge_s = now - self.last_fault_done
                self.report.settle_s = now - self.workload_done
                self.event("settled: the ledger equals the API server, every pending pod has a why")
                return
            time.sleep(1.0)
        self.report.unsettled.extend(problems[:50])
        self.event(f"NOT settled after {timeout_s:.0f} s: {len(problems)} differences")

    def wait_full_pass(self, timeout_s: float) -> None:
        """Wait for a full reconcile pass that began after now."""
        import datetime

        since = datetime.datetime.now(datetime.UTC)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ledger.query(LAST_FULL_SQL, since)[0][0] is not None:
                self.event("the reconciler's next full pass is done")
                return
            time.sleep(1.0)
        self.report.unsettled.append(f"no full reconcile pass within {timeout_s:.0f} s")

    def check(self) -> None:
        """The final checks, on the state after the reconciler's full pass."""
        report = self.report
        pods, _ = list_pods(self.api)
        ledger = self.ledger.bindings()
        report.mismatched = compare(pods, ledger)
        report.doubled = self.mirror.twice_bound()
        report.final_over = over_allocated(api_usage(pods.values()))
        report.final_over += over_allocated(self.card_usage())
        report.final_stuck = [
            f"{b.key}: reserved on {b.node}" for b in ledger.values() if b.phase == "reserved"
        ]
        report.doubled += [row[0] for row in self.ledger.query(TWICE_SQL)]
        for pod in pods.values():
            binding = ledger.get(pod.uid)
            if pod.bound:
                if binding is not None and binding.active and binding.node == pod.node:
                    report.bound += 1
                elif binding is not None and binding.active:
                    report.doubled.append(f"{pod.key}: on {pod.node}, ledger on {binding.node}")
                else:
                    report.lost.append(f"{pod.key}: bound to {pod.node}, not in the ledger")
                continue
            outcome = self.why(pod)
            if outcome in ("unschedulable", "bind_failed", "invalid", "feasible"):
                report.pending_why[outcome] += 1
            else:
                report.lost.append(f"{pod.key}: pending, why answers {outcome or 'nothing'}")
        for created in self.pods.values():
            key = f"{created.plan.namespace}/{created.plan.name}"
            if created.refused:
                report.refused.append(created.refused)
                continue
            report.created += 1
            report.create_retries += created.attempts - 1
            if created.deleted:
                report.deleted += 1
                binding = ledger.get(created.uid)
                if created.uid in pods:
                    report.mismatched.append(f"{key}: deleted, still in the API server")
                if binding is not None and (binding.active or binding.slices):
                    report.mismatched.append(f"{key}: deleted, the ledger holds {binding.slices}")
            elif created.uid not in pods:
                report.lost.append(f"{key}: created (uid {created.uid}), gone")

    def run(self) -> None:
        threads = [
            threading.Thread(target=self.mirror.run, args=(self.stop,), daemon=True),
        ]
        threads[0].start()
        self.mirror.synced.wait(30)
        self.start = time.monotonic()
        self.event(
            f"workload: {len(self.pods)} pods at {self.rate:g}/s, "
            f"{sum(1 for p in self.plan.pods if p.delete_at is not None)} to delete, "
            f"{len(self.plan.faults)} faults"
        )
        sampler = threading.Thread(target=self.sample, daemon=True)
        supervisor = threading.Thread(target=self.supervise, daemon=True)
        lanes = [
            threading.Thread(target=self.inject, args=(kinds,), daemon=True)
            for kinds in (KILLS, RESTARTS)
        ]
        workload = threading.Thread(target=self.workload, daemon=True)
        for thread in (sampler, supervisor, *lanes, workload):
            thread.start()
        while any(thread.is_alive() for thread in (workload, *lanes)):
            for thread in (workload, *lanes):
                thread.join(max(0.0, 10.0 - (self.now() % 10.0)))
            print(f"chaos: +{self.now():6.1f} s  {self.progress()}", flush=True)
        self.settle(timeout_s=180)
        settled = time.monotonic()
        self.wait_full_pass(timeout_s=60)
        self.stop.set()
        sampler.join(5)
        supervisor.join(30)
        self.check()
        self.report.timings["checks after settling"] = time.monotonic() - settled
        self.ledger.close()


def register_nodes(cluster: Cluster, api: objects.Api, nodes: int) -> None:
    """The shared pool's nodes and the small one's, Ready in Kubernetes and with their cards
    reported to Tessera (the admin identity may report any node)."""
    tessera = objects.Tessera(cluster.controlplane_url, cluster.admin_token)
    specs = [(f"gpu-{i:03d}", CARDS_PER_NODE, "shared") for i in range(nodes)]
    specs += [(f"scarce-{i}", SCARCE_CARDS, "scarce") for i in range(SCARCE_NODES)]

    def register(spec: tuple[str, int, str]) -> None:
        name, cards, pool = spec
        api.post("/api/v1/nodes", objects.gpu_node(name, cards=cards, slots=CARD_SLOTS, pool=pool))
        report = objects.inventory(name, cards=cards, memory_mib=CARD_MEMORY_MIB)
        resp = tessera.report_inventory(name, report)
        if resp.status_code not in (200, 201):
            raise HarnessError(f"inventory of {name}: {resp.status_code} {resp.text[:300]}")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(register, specs))
    for i in range(NAMESPACES):
        name = f"chaos-{i}"
        api.post("/api/v1/namespaces", objects.namespace(name))
        api.post(
            f"/api/v1/namespaces/{name}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}},
        )

    def ready() -> bool:
        items = api.get("/api/v1/nodes?labelSelector=type%3Dkwok")["items"]
        return len(items) == len(specs) and all(
            any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in n["status"].get("conditions") or []
            )
            for n in items
        )

    objects.wait_for(ready, timeout=120, what="the kwok nodes Ready", every=1)


def run(pods: int = 2000, seed: int | None = None, rate: float = 15.0) -> Report:
    """A whole chaos run: services and cluster up, the workload and its faults, the checks, and
    everything down again. The report says what happened and what failed."""
    seed = seed if seed is not None else random.SystemRandom().randrange(1, 2**31)
    plan = make_plan(seed, pods, rate, rounds=math.ceil(pods / PODS_PER_ROUND))
    report = Report(seed=seed, planned=pods, nodes=plan.nodes)
    print(f"chaos: seed {seed} ({pods} pods, {plan.nodes} + {SCARCE_NODES} nodes)", flush=True)
    began = time.monotonic()
    services = Services(run_folder("run-chaos-services"), "chaos")
    cluster = Cluster(
        Options(
            run_dir=run_folder("run-chaos"),
            replicas=REPLICAS,
            database_url=services.database_url,
            redis_url=services.redis_url,
            separate_beat=True,
            access_log=False,
            controlplane_env=dict(CONTROLPLANE_ENV),
        )
    )
    try:
        services.up()
        cluster.up()
        report.timings["cluster up"] = time.monotonic() - began
        mark = time.monotonic()
        register_nodes(cluster, objects.Api(cluster), plan.nodes)
        report.timings["nodes"] = time.monotonic() - mark
        mark = time.monotonic()
        Chaos(cluster, services, plan, report, rate).run()
        report.timings["workload, settling and checks"] = time.monotonic() - mark
    finally:
        mark = time.monotonic()
        cluster.down(quiet=True)
        services.down()
        report.timings["down"] = time.monotonic() - mark
        report.timings["total"] = time.monotonic() - began
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=None, help="default: a new one (printed)")
    parser.add_argument("--rate", type=float, default=15.0, help="pods created per second")
    args = parser.parse_args(argv)
    try:
        report = run(args.pods, args.seed, args.rate)
    except HarnessError as exc:
        print(f"chaos: the cluster did not come up: {exc}", file=sys.stderr)
        return 1
    print(report.render())
    violations = report.violations()
    for line in violations:
        print(f"FAILED: {line}")
    print("chaos: " + ("FAILED" if violations else "all checks passed"))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
