"""The reconciler's share of bounded state: the `prune` task (once at a time, on beat's schedule)
and each pass forgetting the decision log entries of pods the cluster no longer has."""

from __future__ import annotations

import io
import time
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.conf import settings
from django.contrib.sessions.backends.db import SessionStore
from django.contrib.sessions.models import Session
from django.core.management import call_command
from django.utils import timezone

from controlplane.kube.sources import PodEvent, PodView, TemporaryError
from controlplane.ledger.models import Card, SchedulingDecision
from controlplane.ledger.services import nodes
from controlplane.reconciler import tasks
from controlplane.reconciler.tasks import (
    LAST_FULL_KEY,
    RESUME_KEY,
    LocalState,
    resume_point,
    run_reconcile,
)
from tests.builders import card_report, make_node
from tests.workers import RedisServer

pytestmark = pytest.mark.django_db


class Cluster:
    """An API server with these pods; a watch from any version yields `events`."""

    def __init__(self, *pods: PodView, events: tuple[PodEvent, ...] = ()) -> None:
        self.pods, self.events = list(pods), events

    def list_pods(self, page_size: int = 500):
        return self.pods, "10"

    def watch_pods(self, rv, timeout_s):
        return iter(self.events)

    def get_pod(self, namespace, name):
        return next((p for p in self.pods if p.name == name), None)

    def list_node_names(self):
        return {"n1"}

    def last_resource_version(self):
        return "10"

    def current_resource_version(self):
        return "10"

    def cluster_identity(self):
        return "uid-of-kube-system"


def pending(name: str) -> PodView:
    return PodView(f"uid-default-{name}", "default", name, None, "Pending", {})


def entry(name: str, decided_at=None) -> None:
    SchedulingDecision.objects.create(
        pod_uid=f"uid-default-{name}", namespace="default", name=name, outcome="unschedulable",
        summary="no room", decided_at=decided_at or timezone.now() - timedelta(seconds=5),
    )  # fmt: skip


def logged() -> set[str]:
    return set(SchedulingDecision.objects.values_list("name", flat=True))


def test_a_full_relist_forgets_the_entries_of_pods_that_are_gone() -> None:
    entry("still-pending")
    entry("deleted-while-pending")
    entry("newer-than-the-list", decided_at=timezone.now() + timedelta(minutes=1))
    run_reconcile(Cluster(pending("still-pending")), LocalState(), full=True)
    assert logged() == {"still-pending", "newer-than-the-list"}


def test_a_watch_pass_forgets_the_entries_of_deleted_pods() -> None:
    entry("deleted")
    entry("changed")
    events = (
        PodEvent("DELETED", pending("deleted")),
        PodEvent("MODIFIED", pending("changed")),
    )
    saved = resume_point("uid-of-kube-system", "10")
    state = LocalState({RESUME_KEY: saved, LAST_FULL_KEY: str(time.time())})
    run = run_reconcile(Cluster(pending("changed"), events=events), state, full=False)
    assert run.mode == "watch"
    assert logged() == {"changed"}


def test_run_prune_deletes_what_is_past_its_retention() -> None:
    make_node("n1", cards=2, memory_mib=10000)
    report = nodes.InventoryReport("test", (card_report("GPU-n1-0", 0, 10000),))
    nodes.apply_inventory("n1", report, "n1")
    Card.objects.filter(uuid="GPU-n1-1").update(last_seen=timezone.now() - timedelta(days=8))
    entry("old", decided_at=timezone.now() - timedelta(days=2))
    entry("recent")
    expired = SessionStore()
    expired.set_expiry(-10)
    expired.create()
    live = SessionStore()
    live.create()

    result = tasks.run_prune()

    assert result.cards == ("GPU-n1-1",) and result.decisions == 1
    assert set(Card.objects.values_list("uuid", flat=True)) == {"GPU-n1-0"}
    assert logged() == {"recent"}
    assert set(Session.objects.values_list("session_key", flat=True)) == {live.session_key}
    assert tasks.run_prune() == tasks.PruneResult((), 0)  # level-based: nothing left to do


def test_beat_sends_prune_on_its_own_schedule() -> None:
    scheduled = settings.CELERY_BEAT_SCHEDULE["prune"]
    assert scheduled["task"] == tasks.prune.name == "controlplane.reconciler.tasks.prune"
    assert scheduled["schedule"] == float(settings.PRUNE_PERIOD_S)
    assert scheduled["options"]["expires"] == float(settings.PRUNE_PERIOD_S)


def test_prune_runs_once_at_a_time(settings, redis_server: RedisServer) -> None:
    settings.REDIS_URL = redis_server.url
    entry("old", decided_at=timezone.now() - timedelta(days=2))
    holder = redis.Redis.from_url(redis_server.url).lock(tasks.PRUNE_LOCK_KEY, timeout=60)
    assert holder.acquire(blocking=False)
    assert tasks.prune.apply().get() == {"skipped": "another prune is running"}
    assert logged() == {"old"}
    holder.release()
    assert tasks.prune.apply().get() == {"cards": [], "decisions": 1}
    assert logged() == set()
    # the lock is released after the run: the next one runs too
    assert tasks.prune.apply().get() == {"cards": [], "decisions": 0}


def test_the_reconcile_command_prunes_once_when_asked() -> None:
    make_node("n1", cards=2, memory_mib=10000)
    nodes.apply_inventory(
        "n1", nodes.InventoryReport("test", (card_report("GPU-n1-0", 0, 10000),)), "n1"
    )
    Card.objects.filter(uuid="GPU-n1-1").update(last_seen=timezone.now() - timedelta(days=8))
    out = io.StringIO()
    call_command("reconcile", stdout=out)
    assert Card.objects.filter(uuid="GPU-n1-1").exists()  # a plain pass does not prune
    call_command("reconcile", "--prune", stdout=out)
    assert not Card.objects.filter(uuid="GPU-n1-1").exists()
    assert "prune: 1 card(s), 0 decision(s)" in out.getvalue()


def test_a_temporary_error_is_retried_with_jittered_backoff_and_a_bug_is_not(
    settings, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery retries the reconcile pass that met the API server or Redis away, after a
    countdown within the backoff's bound (uniform in [0, 2**retries] s); anything else fails at
    once. The lock is let go either way, so the retry can take it."""
    from types import SimpleNamespace

    settings.REDIS_URL = redis_server.url
    countdowns: list[tuple[int, float]] = []
    real_retry = tasks.reconcile.retry

    def spy(*args: Any, **kwargs: Any) -> Any:
        countdowns.append((tasks.reconcile.request.retries, kwargs["countdown"]))
        return real_retry(*args, **kwargs)

    monkeypatch.setattr(tasks.reconcile, "retry", spy)
    monkeypatch.setattr(tasks.adapter, "cluster_source", lambda: None)
    calls: list[int] = []

    def away_twice(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) % 3:
            raise TemporaryError("the API server is away")
        return SimpleNamespace(pk=len(calls), mode="full", drift={})

    monkeypatch.setattr(tasks, "run_reconcile", away_twice)
    for _ in range(10):
        result = tasks.reconcile.apply()  # eager: Celery runs each retry at once
        assert result.state == "SUCCESS", result.result
    assert [r for r, _ in countdowns] == [0, 1] * 10
    assert all(0 <= c <= 2**r for r, c in countdowns), countdowns
    assert len({round(c, 6) for _, c in countdowns}) > 2  # jittered, not one fixed delay
    assert not redis.Redis.from_url(redis_server.url).exists(tasks.LOCK_KEY)

    def bug(*args: Any, **kwargs: Any) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(tasks, "run_reconcile", bug)
    failed = tasks.reconcile.apply()
    assert failed.state == "FAILURE" and isinstance(failed.result, ValueError)
    assert len(countdowns) == 20  # not retried
