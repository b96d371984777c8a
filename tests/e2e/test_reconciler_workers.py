"""The reconciler's workers against the real API server: Redis restarted mid-run, two workers.

The same scenarios as tests/reconciler/test_worker.py, with the harness's kube-apiserver in
place of the embedded stand-in. The harness's own `celery worker --beat` is stopped meanwhile
(it would repair what these tests leave to theirs) and started again after; each test starts
workers and a beat of its own with the control plane's settings (its database, the real API
server) on a Redis of the test's own, which it can kill and restart. The pods live in a namespace
the webhook skips, with a scheduler name nobody serves (as in test_reconciler.py), so only the
test binds them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from controlplane.reconciler.tasks import LOCK_KEY
from e2e import objects
from e2e.cluster import Cluster
from tests.e2e.conftest import NODES
from tests.e2e.test_reconciler import bind, pending_pod
from tests.workers import RedisServer, celery_args, wait_for

pytestmark = pytest.mark.usefixtures("gpu_nodes")

PERIOD_S = 1  # beat sends a reconcile every second
WATCH_S = 2  # and a watch run holds the lock for two: runs would overlap without it
GHOSTS = 40


class Workers:
    """Celery processes of one test, run by the harness (logs in its logs folder)."""

    def __init__(self, cluster: Cluster, redis_url: str, workdir: Path) -> None:
        self.cluster, self.workdir = cluster, workdir
        self.names: list[str] = []
        self.env = {
            "REDIS_URL": redis_url,
            "TESSERA_RECONCILE_PERIOD_S": str(PERIOD_S),
            "TESSERA_WATCH_TIMEOUT_S": str(WATCH_S),
        }

    def start(self, role: str, name: str) -> None:
        self.names.append(name)
        args = celery_args(role, name, self.workdir)
        self.cluster.start_celery(name, args, env=self.env, settle_s=1)

    def log(self, name: str) -> str:
        return (self.cluster.logs / f"{name}.log").read_text(errors="replace")

    @contextlib.contextmanager
    def logs_on_failure(self) -> Iterator[None]:
        try:
            yield
        except AssertionError:
            for name in self.names:
                print(f"--- {name}\n{self.log(name)[-3000:]}")
            raise


@pytest.fixture
def workers(cluster: Cluster, redis_server: RedisServer, tmp_path: Path) -> Iterator[Workers]:
    cluster.stop_component("celery")
    workers = Workers(cluster, redis_server.url, tmp_path)
    try:
        yield workers
    finally:
        for name in workers.names:
            cluster.stop_component(name)
        cluster.start_celery()  # the later tests' reconciler


def ledger(cluster: Cluster, code: str, **values: Any) -> Any:
    """Run `code` in the control plane's Django shell (its database) with `values` bound; it
    sets `result`, which comes back through JSON (datetimes as ISO strings)."""
    bound = "".join(f"{k} = json.loads({json.dumps(v)!r})\n" for k, v in values.items())
    out = cluster.manage(
        "shell", "--no-startup", "--command",
        f"import json\n{bound}{code}\nprint('RESULT ' + json.dumps(result, default=str))\n",
    )  # fmt: skip
    line = next(x for x in reversed(out.splitlines()) if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


RUNS_SINCE = """
from datetime import datetime
from controlplane.reconciler.models import ReconcileRun
since = datetime.fromisoformat(since)
result = list(ReconcileRun.objects.filter(started_at__gt=since).order_by("started_at").values(
    "started_at", "finished_at", "duration_ms", "mode", "drift"))
"""


def runs_since(cluster: Cluster, since: datetime) -> list[dict[str, Any]]:
    runs = ledger(cluster, RUNS_SINCE, since=since.isoformat())
    for run in runs:
        for key in ("started_at", "finished_at"):
            run[key] = run[key] and datetime.fromisoformat(run[key])
    return list(runs)


def test_redis_restarted_during_a_run_then_the_next_run_completes(
    cluster: Cluster, core: Any, unmanaged: str, redis_server: RedisServer, workers: Workers
) -> None:
    ghosts = [f"ghost-{i}" for i in range(GHOSTS)]
    placement = {name: NODES[i % len(NODES)] for i, name in enumerate([*ghosts, "keeper"])}
    for name in placement:
        pending_pod(core, unmanaged, name, 1000)
    for name in ghosts:
        bind(core, unmanaged, name, placement[name], {})
    # The ledger as the extender leaves it: the ghosts bound and running, the keeper reserved
    # (its Binding comes later).
    ledger(cluster, (
        "from controlplane.kube.adapter import get_kube\n"
        "from controlplane.ledger import selectors\n"
        "from controlplane.ledger.services import bindings\n"
        "from controlplane.scheduling import parse_pod\n"
        "config = selectors.scheduling_config()\n"
        "for name, node in placement.items():\n"
        "    request = parse_pod(get_kube().get_pod(namespace, name), config)\n"
        "    bindings.bind_pod(request, node)\n"
        "    if name != 'keeper':\n"
        "        bindings.confirm_binding(request.uid)\n"
        "result = None\n"
    ), placement=placement, namespace=unmanaged)  # fmt: skip

    workers.start("worker", "restart-w1")
    workers.start("beat", "restart-beat")
    with workers.logs_on_failure():
        wait_for(lambda: redis_server.has_key(LOCK_KEY), 60, "a reconcile run to hold its lock")
        redis_server.kill()  # mid-run: the lock, the resume point and the queue go with it
        # The interrupted run's watch ends (with a second to spare); no run starts while Redis
        # is away (no lock, no queue). What changes now only a run after the restart can see.
        time.sleep(WATCH_S + 2)
        for name in ghosts:
            core.delete_namespaced_pod(name, unmanaged, grace_period_seconds=0)
        bind(core, unmanaged, "keeper", placement["keeper"], {})
        restarted = datetime.now(UTC)
        redis_server.start()

        state_code = (
            "from controlplane.ledger.models import PodBinding, Slice\n"
            "result = {\n"
            "    'phases': dict(PodBinding.objects.filter(namespace=namespace)\n"
            "                   .values_list('name', 'phase')),\n"
            "    'bindings': PodBinding.objects.filter(namespace=namespace).count(),\n"
            "    'active_slices': sorted(Slice.objects.filter(\n"
            "        binding__namespace=namespace, active=True).values_list(\n"
            "        'binding__name', flat=True)),\n"
            "}\n"
        )

        def repaired() -> dict[str, Any] | None:
            state = ledger(cluster, state_code, namespace=unmanaged)
            phases = state["phases"]
            done = phases["keeper"] == "bound" and all(
                phases[name] == "released" for name in ghosts
            )
            return state if done else None

        state = objects.wait_for(
            repaired, timeout=60, what="the ghosts released and the keeper confirmed", every=1
        )
        assert state["bindings"] == GHOSTS + 1  # nothing doubled
        assert state["active_slices"] == ["keeper"]  # only the keeper holds its slice

        runs = runs_since(cluster, restarted)
        assert runs, "no reconcile run started after Redis came back"
        assert all(run["finished_at"] for run in runs)
        # The resume point went with Redis: the first run relists, and it (or the next) made
        # the repairs: only runs after the restart can have seen them.
        assert runs[0]["mode"] == "full", runs
        drift: Counter[str] = Counter()
        for run in runs:
            drift.update(run["drift"])
        assert drift["released_deleted"] >= GHOSTS, runs
        assert drift["confirmed_reservation"] >= 1, runs
    core.delete_namespaced_pod("keeper", unmanaged, grace_period_seconds=0)


def test_two_workers_and_beat_run_one_reconcile_at_a_time(
    cluster: Cluster, workers: Workers
) -> None:
    since = datetime.now(UTC)
    workers.start("worker", "pair-w1")
    workers.start("worker", "pair-w2")
    workers.start("beat", "pair-beat")
    with workers.logs_on_failure():
        objects.wait_for(
            lambda: len(runs_since(cluster, since)) >= 5, timeout=60, what="five reconcile runs",
            every=1,
        )  # fmt: skip
        runs = runs_since(cluster, since)
        for before, after in itertools.pairwise(runs):
            assert after["started_at"] >= before["finished_at"], f"two runs overlapped: {runs}"
        assert all(run["duration_ms"] is not None for run in runs)
        # Watch runs outlast beat's period, and both workers were handed runs: without the lock
        # they would have overlapped; with it, a worker that finds it held steps aside.
        assert max(run["duration_ms"] for run in runs) > PERIOD_S * 1000, runs
        logs = {name: workers.log(name) for name in ("pair-w1", "pair-w2")}
        for name, text in logs.items():
            assert "tasks.reconcile[" in text and "succeeded" in text, f"{name} ran no reconcile"
        assert any("another reconcile is running" in text for text in logs.values())
