"""Full resync of the reconciler: 1,000 nodes, 20,000 pods. Prints time and peak memory.

    python bench/bench_reconcile.py            # temporary SQLite database
    DATABASE_URL=postgres://... python bench/bench_reconcile.py
    python bench/bench_reconcile.py --nodes 5000 --pods 200000   # Kubernetes' largest cluster

Each figure is the median of several runs of `run_reconcile(full=True)` over pods given as the
API server's JSON (converted to PodView as the real source does), against a ledger of 20,000
active bindings with one slice each: (a) nothing to repair; (b) 1,000 pods deleted meanwhile,
so 1,000 releases. Peak memory is the Python heap's peak during the run (tracemalloc) and the
process's peak RSS. Targets: <= 10 s and <= 500 MB at 1,000 nodes; <= 30 s and <= 1 GB at
5,000 nodes and 200,000 pods.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TMP = tempfile.mkdtemp(prefix="tessera-bench-reconcile-")
os.environ.setdefault("DATABASE_URL", f"sqlite:///{TMP}/bench.sqlite3")
os.environ["TESSERA_LOCAL_DIR"] = TMP
os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from django.utils import timezone  # noqa: E402

from controlplane.kube.sources import PodEvent, PodView, pod_view  # noqa: E402
from controlplane.ledger.models import Card, Node, PodBinding, Slice  # noqa: E402
from controlplane.reconciler.tasks import LocalState, run_reconcile  # noqa: E402

CARDS = 8
# Set from the command line by main(); read by the builders below.
NODES, PODS = 1000, 20000


class ListSource:
    """A cluster of pods given as JSON, listed in pages like the API server would."""

    def __init__(self, pods: list[dict]) -> None:
        self.pods = pods

    def list_pods(self, page_size: int = 500) -> tuple[list[PodView], str]:
        views: list[PodView] = []
        for start in range(0, len(self.pods), page_size):
            views.extend(pod_view(p) for p in self.pods[start : start + page_size])
        return views, "1"

    def watch_pods(self, resource_version: str, timeout_s: float):  # pragma: no cover
        return iter(list[PodEvent]())

    def list_node_names(self) -> set[str]:
        return {f"node-{i:04d}" for i in range(NODES)}

    def last_resource_version(self) -> str:
        return "1"

    def cluster_identity(self) -> str:
        return "bench"

    def current_resource_version(self) -> str:
        return "1"


def build_ledger() -> list[dict]:
    if connection.vendor == "postgresql":
        print("database: PostgreSQL (tables truncated)")
        with connection.cursor() as cursor:
            cursor.execute(
                "TRUNCATE ledger_slice, ledger_podbinding, ledger_card, ledger_node, "
                "reconciler_reconcilerun CASCADE"
            )
    now = timezone.now()
    Node.objects.bulk_create(Node(name=f"node-{i:04d}", last_heartbeat=now) for i in range(NODES))
    nodes = list(Node.objects.order_by("name"))
    Card.objects.bulk_create(
        Card(
            node=n,
            uuid=f"GPU-{n.name}-{c}",
            index=c,
            model="NVIDIA A100",
            memory_mib=81920,
            slots=10,
            last_seen=now,
        )
        for n in nodes
        for c in range(CARDS)
    )
    cards = list(Card.objects.order_by("id").values_list("id", "node_id"))
    node_names = {n.pk: n.name for n in nodes}
    PodBinding.objects.bulk_create(
        (
            PodBinding(
                pod_uid=f"uid-{i}",
                namespace="bench",
                name=f"pod-{i}",
                node_id=cards[i % len(cards)][1],
                phase=PodBinding.Phase.BOUND,
                request={},
                reserved_at=now,
                bound_at=now,
            )
            for i in range(PODS)
        ),
        batch_size=2000,
    )
    binding_ids = dict(PodBinding.objects.values_list("pod_uid", "id"))
    Slice.objects.bulk_create(
        (
            Slice(
                binding_id=binding_ids[f"uid-{i}"],
                card_id=cards[i % len(cards)][0],
                container_name="main",
                container_index=0,
                memory_mib=2048,
                compute_percent=10,
            )
            for i in range(PODS)
        ),
        batch_size=2000,
    )
    return [
        {
            "metadata": {
                "uid": f"uid-{i}",
                "namespace": "bench",
                "name": f"pod-{i}",
                "annotations": {},
            },
            "spec": {"nodeName": node_names[cards[i % len(cards)][1]]},
            "status": {"phase": "Running"},
        }
        for i in range(PODS)
    ]


def measure(source: ListSource) -> tuple[float, float, dict]:
    # The nodes' plugins "report" before each run: at 5,000 nodes a few runs outlast the
    # heartbeat's staleness limit, and stale nodes would be repair work no run is meant to have.
    Node.objects.update(last_heartbeat=timezone.now())
    tracemalloc.start()
    start = time.perf_counter()
    run = run_reconcile(source, LocalState(), full=True)
    elapsed = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return elapsed, peak, run.drift


def main() -> None:
    global NODES, PODS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=NODES)
    parser.add_argument("--pods", type=int, default=PODS)
    args = parser.parse_args()
    if args.nodes < 1 or args.pods < 2000:
        parser.error("--nodes must be >= 1 and --pods >= 2000 (run (b) deletes 1,000 pods)")
    NODES, PODS = args.nodes, args.pods
    large = NODES > 1000
    limit_s, limit_mb = (30, 1000) if large else (10, 500)
    call_command("migrate", verbosity=0)
    t0 = time.perf_counter()
    pods = build_ledger()
    print(
        f"ledger: {NODES} nodes x {CARDS} cards, {PODS} bound pods "
        f"(built in {time.perf_counter() - t0:.1f} s)"
    )
    clean = [measure(ListSource(pods)) for _ in range(3)]
    assert all(d == {} for _, _, d in clean), clean
    print(
        f"(a) full resync, no drift:      median {statistics.median(t for t, _, _ in clean):.2f} s"
        f", heap peak {max(p for _, p, _ in clean):.0f} MiB"
    )
    deleted = measure(ListSource(pods[1000:]))
    assert deleted[2] == {"released_deleted": 1000}, deleted[2]
    print(
        f"(b) full resync, 1,000 deleted: {deleted[0]:.2f} s, heap peak {deleted[1]:.0f} MiB, "
        f"drift {deleted[2]}"
    )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"process peak RSS: {rss:.0f} MiB   targets: <= {limit_s} s, <= {limit_mb} MB")


if __name__ == "__main__":
    main()
