"""The reconciler as it runs in production: real Celery workers and beat over real Redis.

The workers are separate processes sharing the test database; the cluster is the embedded
stand-in (database-backed), so the test and the workers see the same pods.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.kube.embedded import EmbeddedKube
from controlplane.ledger import allocation
from controlplane.ledger.models import Card, PodBinding, SchedulingDecision, Slice
from controlplane.ledger.services import bindings, nodes
from controlplane.reconciler.models import ReconcileRun
from controlplane.reconciler.tasks import LOCK_KEY
from controlplane.scheduling import parse_pod
from tests.builders import card_report, make_node
from tests.pods import gpu_container, pod_json
from tests.workers import RedisServer, celery_args, wait_for

ROOT = Path(__file__).resolve().parents[2]
PERIOD_S = 1
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def database_url() -> str:
    """The test database (not the configured one) as a URL a worker process can open."""
    s = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{s['NAME']}"
    auth = s["USER"] + (f":{s['PASSWORD']}" if s.get("PASSWORD") else "")
    return f"postgres://{auth}@{s['HOST']}:{s['PORT']}/{s['NAME']}"


class Celery:
    """Worker and beat processes; stopped (process group) at the end, logs kept for failures."""

    def __init__(self, tmp: Path, redis_url: str, **env: str) -> None:
        self.tmp, self.procs = tmp, []
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")},
            "DJANGO_SETTINGS_MODULE": "controlplane.test_settings",
            "DATABASE_URL": database_url(),
            "REDIS_URL": redis_url,
            "TESSERA_KUBE_MODE": "embedded",
            "TESSERA_LOCAL_DIR": str(tmp / "local"),
            "TESSERA_RECONCILE_PERIOD_S": str(PERIOD_S),
            "TESSERA_WATCH_TIMEOUT_S": "1",
            **env,
        }

    def start(self, role: str, name: str, args: list[str] | None = None) -> None:
        """A worker or beat with the tests' arguments (`celery_args`), or with `args`."""
        args = [
            sys.executable, "-m", "celery", "-A", "controlplane.celery",
            *(args or celery_args(role, name, self.tmp)),
        ]  # fmt: skip
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.procs.append(
            (
                name,
                log,
                subprocess.Popen(
                    args,
                    cwd=ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                ),
            )
        )

    def stop(self) -> None:
        for _, _log, proc in self.procs:
            with_suppressed(lambda p=proc: os.killpg(p.pid, signal.SIGTERM))
        for _, log, proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with_suppressed(lambda p=proc: os.killpg(p.pid, signal.SIGKILL))
            log.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{(self.tmp / f'{name}.log').read_text(errors='replace')[-3000:]}"
            for name, _, _ in self.procs
        )


def with_suppressed(fn: Callable[[], object]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        fn()


@pytest.fixture
def celery_factory(tmp_path: Path, redis_server: RedisServer) -> Iterator[Callable[..., Celery]]:
    made: list[Celery] = []

    def make(**env: str) -> Celery:
        c = Celery(tmp_path, redis_server.url, **env)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def bound_pod(kube: EmbeddedKube, name: str, mem: int = 1000, sign: bool = False) -> str:
    """A pod created in the stand-in and bound to n1, optionally with a signed allocation."""
    obj = kube.create_pod(pod_json(name, containers=[gpu_container(mem=mem)]))
    uid = obj["metadata"]["uid"]
    annotations: dict[str, str] = {}
    if sign:
        record = allocation.allocation_record(
            uid,
            "default",
            name,
            "n1",
            [
                allocation.ContainerAllocation(
                    "c", 0, False, (allocation.Device("GPU-n1-0", 0, mem, 0),)
                )
            ],
        )
        annotations = allocation.annotations(record)
    kube.bind_pod("default", name, uid, "n1", annotations)
    return uid


def reserve_for(kube: EmbeddedKube, name: str) -> str:
    obj = kube.create_pod(pod_json(name, containers=[gpu_container(mem=1000)]))
    pod = dict(obj)
    request = parse_pod(pod)
    assert request is not None
    bindings.bind_pod(request, "n1")
    return request.uid


def phase_of(uid: str) -> str | None:
    return PodBinding.objects.filter(pod_uid=uid).values_list("phase", flat=True).first()


def test_worker_and_beat_repair_deletion_expiry_and_adoption(celery_factory) -> None:
    kube = EmbeddedKube()
    make_node("n1", cards=2, memory_mib=20000)
    # a bound pod the ledger knows
    doomed = reserve_for(kube, "doomed")
    kube.bind_pod("default", "doomed", doomed, "n1", {})
    bindings.confirm_binding(doomed)
    # a reservation whose Binding never reached the API server
    stuck = reserve_for(kube, "stuck")
    deadline = timezone.now() + timedelta(seconds=4)
    PodBinding.objects.filter(pod_uid=stuck).update(deadline=deadline)

    celery = celery_factory()
    celery.start("worker", "w1")
    celery.start("beat", "beat")
    try:
        wait_for(lambda: ReconcileRun.objects.exists(), 60, "the first reconcile run")
        assert phase_of(doomed) == "bound"  # its pod exists: nothing to repair

        kube.delete_pod("default", "doomed")
        took = wait_for(lambda: phase_of(doomed) == "released", 30, "release of a deleted pod")
        # one period, plus the watch window of the run that sees the event, plus start-up slack
        assert took <= PERIOD_S + 1 + 2.5, took
        assert not Slice.objects.filter(binding__pod_uid=doomed, active=True).exists()

        if timezone.now() < deadline - timedelta(seconds=1):
            assert phase_of(stuck) == "reserved"  # still within its deadline
        wait_for(lambda: phase_of(stuck) == "failed", 30, "release of an expired reservation")
        assert timezone.now() >= deadline

        lost = bound_pod(kube, "lost", mem=3000, sign=True)  # bound, signed, not in the ledger
        wait_for(lambda: phase_of(lost) == "bound", 30, "adoption of a bound pod")
        adopted = PodBinding.objects.get(pod_uid=lost)
        assert list(adopted.slices.values_list("card__uuid", "memory_mib")) == [("GPU-n1-0", 3000)]
    except AssertionError:
        print(celery.logs())
        raise


def test_beat_and_a_worker_prune_a_long_missing_card_and_old_decisions(celery_factory) -> None:
    make_node("n1", cards=2, memory_mib=20000)
    report = nodes.InventoryReport("test", (card_report("GPU-n1-0", 0, 20000),))
    nodes.apply_inventory("n1", report, "n1")  # GPU-n1-1 is gone from the node's reports
    Card.objects.filter(uuid="GPU-n1-1").update(last_seen=timezone.now() - timedelta(days=8))
    SchedulingDecision.objects.create(
        pod_uid="uid-old", namespace="default", name="old", outcome="unschedulable",
        summary="no room", decided_at=timezone.now() - timedelta(days=2),
    )  # fmt: skip

    celery = celery_factory(TESSERA_PRUNE_PERIOD_S="1")
    celery.start("worker", "w1")
    celery.start("beat", "beat")
    try:
        wait_for(lambda: not Card.objects.filter(uuid="GPU-n1-1").exists(), 60, "the prune")
        wait_for(lambda: not SchedulingDecision.objects.exists(), 30, "the decision log pruned")
        assert Card.objects.filter(uuid="GPU-n1-0").exists()
    except AssertionError:
        print(celery.logs())
        raise


def ghosts_on_n1(kube: EmbeddedKube) -> list[str]:
    """Node n1, and many bindings on it whose pods are gone, so the run that releases them
    takes a while; their pod UIDs."""
    make_node("n1", cards=8, memory_mib=80000)
    Card.objects.update(slots=100)
    ghosts = [reserve_for(kube, f"ghost-{i}") for i in range(400)]
    for i in range(400):
        kube.delete_pod("default", f"ghost-{i}")
    return ghosts


def restart_redis_mid_run(redis_server: RedisServer) -> None:
    """Kill Redis while a reconcile run holds its lock (the lock, the resume point and the queue
    go with it), start it again, and wait for a run that started after that."""
    wait_for(lambda: redis_server.has_key(LOCK_KEY), 60, "a reconcile run to hold its lock")
    redis_server.kill()
    time.sleep(1)
    redis_server.start()
    restarted = timezone.now()
    wait_for(
        lambda: ReconcileRun.objects.filter(started_at__gt=restarted).exists(),
        60,
        "a reconcile run after the restart",
    )


def test_redis_restarted_during_a_run_then_the_next_run_completes(
    celery_factory, redis_server: RedisServer
) -> None:
    kube = EmbeddedKube()
    ghosts = ghosts_on_n1(kube)
    keeper = reserve_for(kube, "keeper")
    kube.bind_pod("default", "keeper", keeper, "n1", {})

    celery = celery_factory(TESSERA_FULL_RESYNC_S="0")
    celery.start("worker", "w1")
    celery.start("beat", "beat")
    try:
        restart_redis_mid_run(redis_server)
        wait_for(
            lambda: (
                PodBinding.objects.filter(pod_uid__in=ghosts, phase="released").count()
                == len(ghosts)
            ),
            60,
            "every ghost released",
        )
        assert phase_of(keeper) == "bound"  # its Binding landed: confirmed
        assert Slice.objects.filter(active=True).count() == 1  # only the keeper's
        assert PodBinding.objects.count() == len(ghosts) + 1  # nothing doubled
    except AssertionError:
        print(celery.logs())
        raise


def test_a_prefork_worker_outlives_a_redis_restart_during_a_run(
    celery_factory, redis_server: RedisServer
) -> None:
    # The worker as the chart runs it (prefork, two processes, gossip and mingle): the run
    # executes in a child process while the main process holds its message unacknowledged
    # (acks late) and sees the broker go away.
    ghosts_on_n1(EmbeddedKube())
    celery = celery_factory(TESSERA_FULL_RESYNC_S="0")
    celery.start(
        "worker",
        "w1",
        ["worker", "--loglevel=INFO", "--queues=tessera", "--concurrency=2", "--hostname=w1@%h"],
    )
    celery.start("beat", "beat")
    try:
        restart_redis_mid_run(redis_server)
        worker = next(proc for name, _, proc in celery.procs if name == "w1")
        assert worker.poll() is None, f"the worker exited with {worker.returncode}"
    except AssertionError:
        print(celery.logs())
        raise


def test_two_workers_and_beat_run_one_reconcile_at_a_time(celery_factory) -> None:
    kube = EmbeddedKube()
    make_node("n1", cards=8, memory_mib=80000)
    for i in range(20):
        uid = reserve_for(kube, f"p-{i}")
        kube.bind_pod("default", f"p-{i}", uid, "n1", {})
    # Each run watches for 2 s while beat sends a run every 1 s to two workers: without the lock
    # runs would overlap all the time.
    celery = celery_factory(TESSERA_WATCH_TIMEOUT_S="2")
    celery.start("worker", "w1")
    celery.start("worker", "w2")
    celery.start("beat", "beat")
    try:
        wait_for(lambda: ReconcileRun.objects.count() >= 5, 90, "five reconcile runs")
    finally:
        celery.stop()
    runs = list(
        ReconcileRun.objects.order_by("started_at").values_list(
            "started_at", "finished_at", "duration_ms"
        )
    )
    for (_, finished, _), (started, _, _) in itertools.pairwise(runs):
        assert started >= finished, f"two reconcile runs overlapped: {runs}"
    assert all(r[2] is not None for r in runs)
    assert PodBinding.objects.filter(phase="reserved").count() == 0  # every one confirmed
