"""Benchmark: dashboard pages at 1,000 nodes x 8 cards with 20,000 active slices.

Builds the ledger in a temporary SQLite database with bulk_create, then prints, per page, the
server time (median and 99th percentile of several requests through django.test.Client, so
middleware, session, queries and template rendering are all counted; no network), the number of
SQL queries and the size of the body.
It builds a second, smaller ledger too and checks that the query counts are the same: they must
not grow with the data.

    .venv/bin/python bench/bench_dashboard.py [--nodes 1000] [--cards 8] [--slices 20000]

Target: <= 300 ms per page. Exit status 1 when a page misses it or when a query count
grows with the data.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TARGET_MS = 300.0
PAGES = [
    ("overview", "/"),
    ("overview (live fragment)", "/?fragment=1"),
    ("nodes", "/nodes/"),
    ("nodes page 10", "/nodes/?page=10"),
    ("bindings", "/bindings/"),
    ("bindings filtered", "/bindings/?namespace=team-3&phase=bound&sort=node"),
    ("quotas", "/quotas/"),
    ("audit", "/audit/"),
    ("card", "/cards/GPU-bench-node-0007-3/"),
    ("grid", "/grid/"),
    ("grid by free memory", "/grid/?sort=free&colour=compute"),
    ("grid namespace+state", "/grid/?namespace=team-3&state=healthy"),
    ("metrics", "/metrics"),
]
TARGETED = {"overview", "nodes", "bindings", "grid"}


def build(nodes: int, cards: int, slices: int, seed: int = 7) -> None:
    """Write the ledger rows with bulk_create (no services: this is about reading speed)."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from controlplane.access.roles import Role
    from controlplane.access.services import grant_role
    from controlplane.ledger.models import (
        AuditEvent,
        Card,
        NamespaceQuota,
        Node,
        PodBinding,
        SchedulingDecision,
        Slice,
    )

    rng = random.Random(seed)
    now = timezone.now()
    Node.objects.bulk_create(
        Node(name=f"bench-node-{i:04d}", last_heartbeat=now, plugin_version="bench")
        for i in range(nodes)
    )
    node_ids = list(Node.objects.order_by("name").values_list("id", flat=True))
    Card.objects.bulk_create(
        Card(
            node_id=node_id,
            uuid=f"GPU-bench-node-{n:04d}-{c}",
            index=c,
            model="NVIDIA A100-SXM4-80GB",
            memory_mib=81920,
            slots=10,
            numa_node=c // 4,
            healthy=rng.random() > 0.002,
            cordoned=rng.random() < 0.002,
            mode="mig" if c == 7 and n % 10 == 0 else "shared",
            pending_mode="exclusive" if rng.random() < 0.002 else "",
            last_seen=now,
        )
        for n, node_id in enumerate(node_ids)
        for c in range(cards)
    )
    card_rows = list(Card.objects.values_list("id", "node_id"))
    sizes = [4096, 8192, 8192, 10240, 20480]
    bindings: list[PodBinding] = []
    plan: list[tuple[int, list[int]]] = []  # (node_id, card ids) per binding
    remaining = slices
    i = 0
    while remaining > 0:
        width = 2 if remaining >= 2 and i % 3 == 0 else 1
        first = rng.randrange(len(card_rows))
        node_id = card_rows[first][1]
        same_node = [cid for cid, nid in card_rows[first : first + cards] if nid == node_id]
        chosen = same_node[:width]
        bindings.append(
            PodBinding(
                pod_uid=f"uid-{i}",
                namespace=f"team-{i % 40}",
                name=f"job-{i:06d}",
                node_id=node_id,
                phase=rng.choice(["bound", "allocated", "allocated", "reserved"])
                if rng.random() > 0.01
                else "reserved",
                request={},
                reserved_at=now,
            )
        )
        plan.append((node_id, chosen))
        remaining -= len(chosen)
        i += 1
    # Ended pods: their slices stay on record, inactive.
    for j in range(slices // 4):
        node_id = card_rows[j % len(card_rows)][1]
        bindings.append(
            PodBinding(
                pod_uid=f"uid-ended-{j}",
                namespace=f"team-{j % 40}",
                name=f"old-{j:06d}",
                node_id=node_id,
                phase="released",
                request={},
            )
        )
        plan.append((node_id, [card_rows[j % len(card_rows)][0]]))
    PodBinding.objects.bulk_create(bindings, batch_size=2000)
    ids = dict(PodBinding.objects.values_list("pod_uid", "id"))
    Slice.objects.bulk_create(
        (
            Slice(
                binding_id=ids[b.pod_uid],
                card_id=card_id,
                container_name="main",
                container_index=0,
                memory_mib=rng.choice(sizes),
                compute_percent=rng.choice([10, 20, 25, 30]),
                active=b.phase != "released",
            )
            for b, (_, card_ids) in zip(bindings, plan, strict=True)
            for card_id in card_ids
        ),
        batch_size=5000,
    )
    SchedulingDecision.objects.bulk_create(
        SchedulingDecision(
            pod_uid=f"uid-wait-{k}",
            namespace=f"team-{k % 40}",
            name=f"waiting-{k}",
            outcome="unschedulable",
            summary="no node has room",
            decided_at=now,
        )
        for k in range(300)
    )
    NamespaceQuota.objects.bulk_create(
        NamespaceQuota(namespace=f"team-{k}", gpumem_mib=10_000_000, gpucores=100_000, gpus=5000)
        for k in range(0, 40, 2)
    )
    AuditEvent.objects.bulk_create(
        AuditEvent(actor="bench", action="card-health", target_type="card", target=f"GPU-{k}")
        for k in range(5000)
    )
    user = grant_role("bench-viewer", Role.VIEWER)
    assert get_user_model().objects.filter(pk=user.pk).exists()


def measure(repeats: int) -> dict[str, tuple[float, float, int, int, int]]:
    """Per page: (median ms, p99 ms, query count, status, body bytes)."""
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    client = Client()
    client.force_login(get_user_model().objects.get(username="bench-viewer"))
    results = {}
    for label, url in PAGES:
        client.get(url)  # warm: template compilation, first sample of the minute
        times, queries, code, size = [], 0, 0, 0
        for _ in range(repeats):
            with CaptureQueriesContext(connection) as ctx:
                started = time.perf_counter()
                response = client.get(url)
                times.append((time.perf_counter() - started) * 1000)
            queries, code = len(ctx.captured_queries), response.status_code
            size = len(response.content)
        results[label] = (statistics.median(times), p99(times), queries, code, size)
    return results


def p99(times: list[float]) -> float:
    """The 99th percentile, interpolated between the samples (the slowest of a few)."""
    if len(times) < 2:
        return times[0]
    return statistics.quantiles(times, n=100, method="inclusive")[98]


def fresh_database(path: Path) -> None:
    from django.core.management import call_command
    from django.db import connection

    connection.close()
    connection.settings_dict["NAME"] = str(path)
    call_command("migrate", verbosity=0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--cards", type=int, default=8)
    parser.add_argument("--slices", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--keep", action="store_true", help="keep the SQLite files for a look")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tessera-bench-dashboard-"))
    try:
        return run(args, tmp)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def run(args: argparse.Namespace, tmp: Path) -> int:
    """Build both clusters under `tmp`, measure, print the verdict; 1 when a target is missed."""
    os.environ["DATABASE_URL"] = f"sqlite:///{tmp / 'small.sqlite3'}"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.test_settings")
    os.environ.setdefault("TESSERA_KUBE_MODE", "embedded")
    import django

    django.setup()
    from django.test.utils import setup_test_environment

    setup_test_environment()

    sizes = [("small", 20, args.cards, 400), ("full", args.nodes, args.cards, args.slices)]
    runs: dict[str, dict[str, tuple[float, float, int, int, int]]] = {}
    load = os.getloadavg()[0]
    print(f"== {os.cpu_count()} CPUs, load average {load:.1f} (busy machines give noisy figures)")
    for name, nodes, cards, slices in sizes:
        fresh_database(tmp / f"{name}.sqlite3")
        started = time.perf_counter()
        build(nodes, cards, slices)
        built = time.perf_counter() - started
        print(
            f"== {name}: {nodes} nodes x {cards} cards, {slices} active slices "
            f"(built in {built:.1f} s, SQLite {tmp / (name + '.sqlite3')})"
        )
        runs[name] = measure(args.repeats)
        for label, (ms, slowest, queries, code, size) in runs[name].items():
            print(
                f"   {label:26s} median {ms:7.1f} ms (p99 {slowest:6.1f})  "
                f"{queries:3d} queries  HTTP {code}  {size / 1024:7.0f} KiB"
            )

    failed = False
    print(f"== verdict (target <= {TARGET_MS:.0f} ms; query count independent of size)")
    for label, (ms, _, queries, code, _) in runs["full"].items():
        small_queries = runs["small"][label][2]
        problems = []
        if code != 200:
            problems.append(f"HTTP {code}")
        if queries != small_queries:
            problems.append(f"queries grew {small_queries} -> {queries}")
        if label.split(" ")[0] in TARGETED and ms > TARGET_MS:
            problems.append(f"{ms:.0f} ms > {TARGET_MS:.0f} ms")
        failed = failed or bool(problems)
        print(f"   {label:26s} {'FAIL: ' + '; '.join(problems) if problems else 'ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
