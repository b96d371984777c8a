"""Celery tasks of the reconciler. They take no state, re-read the world and call services.

`reconcile` runs once at a time whatever the number of workers (a Redis lock with an expiry, so
a worker killed mid-run blocks the next one for at most the lock's TTL). It watches pod events
from the last resourceVersion it saw and falls back to a full relist when it has none, when that
version was saved on another cluster (the resume point carries the cluster's identity: a
replaced cluster's versions mean nothing here), when the API server says the version expired
(410), when the version is ahead of the API server's (etcd restored from a backup: a watch from
it would wait in silence), or when the last full relist is older than TESSERA_FULL_RESYNC_S.
Temporary errors (API server or Redis away) are retried with exponential backoff and full
jitter, by Celery's own retry options (`RETRY`); a
run that dies half-way has committed only whole repairs, and the next run finds the rest,
because every repair is level-based. Each pass also drops the decision log entries of pods the
cluster no longer has.

`prune` deletes what the ledger need not keep (docs/reconciler.md, "Pruning"): cards long gone
from their node's reports that nothing holds, decision log entries past their use, expired
sessions. Also once at a time (a lock of its own), and bounded per run (PRUNE_BATCH rows of each
kind): a backlog goes over the next runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from importlib import import_module
from typing import Any, Protocol, TypeVar

import redis
from celery import shared_task
from django.conf import settings
from django.utils import timezone

from controlplane.kube import adapter
from controlplane.kube.sources import (
    DRA_DRIVER,
    ClaimsUnreadable,
    ClusterSource,
    TemporaryError,
    WatchExpired,
)
from controlplane.ledger.allocation import verify_allocation
from controlplane.ledger.selectors import decided_pod_uids, expired_reservations
from controlplane.ledger.services import decisions, modes, nodes
from controlplane.reconciler import claims, services
from controlplane.reconciler.models import ReconcileRun

log = logging.getLogger(__name__)

LOCK_KEY = "tessera:reconcile:lock"
# The resume point: {"cluster": <the cluster's identity>, "rv": <the pods' resourceVersion>},
# one value, so a version is never read with another cluster's identity.
RESUME_KEY = "tessera:reconcile:pods-resume"
# The same for ResourceClaims (DRA mode): their own resourceVersion, under the same identity.
CLAIMS_RESUME_KEY = "tessera:reconcile:claims-resume"
# A claims watch replays the backlog since its resume point at once: a pass waits no longer for
# new claim events than this (the pods' watch already waited out the pass's time).
CLAIMS_WATCH_S = 1
LAST_FULL_KEY = "tessera:reconcile:last-full"
PRUNE_LOCK_KEY = "tessera:prune:lock"
# A prune deletes at most a few batches of rows: seconds. Longer than that, the lock has outlived
# a worker that died holding it.
PRUNE_LOCK_TTL_S = 600
# Celery's automatic retry of a task that raised one of these: after a countdown drawn uniformly
# from [0, min(60, 2**retries)] s (full jitter), at most 8 times.
RETRY: dict[str, Any] = {
    "autoretry_for": (TemporaryError, redis.RedisError),
    "retry_backoff": 1,
    "retry_backoff_max": 60,
    "retry_jitter": True,
    "max_retries": 8,
}


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(
        settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=5, health_check_interval=30
    )


@shared_task(name="controlplane.reconciler.tasks.reconcile", **RETRY)
def reconcile(full: bool = False) -> dict[str, Any]:
    """One reconcile pass, or nothing when another worker holds the lock."""
    client = redis_client()
    lock = client.lock(LOCK_KEY, timeout=settings.TESSERA["RECONCILE_LOCK_TTL_S"])
    if not lock.acquire(blocking=False):
        return {"skipped": "another reconcile is running"}
    try:
        run = run_reconcile(adapter.cluster_source(), RedisState(client), full=full)
        return {"run": run.pk, "mode": run.mode, "drift": run.drift}
    except (TemporaryError, redis.RedisError) as exc:
        log.warning("reconcile: temporary error, retrying: %s", exc)
        raise
    finally:
        # Redis restarted or the lock expired: nothing to release; the TTL covers the rest.
        with contextlib.suppress(redis.RedisError):
            lock.release()


@shared_task(name="controlplane.reconciler.tasks.prune", **RETRY)
def prune() -> dict[str, Any]:
    """One prune, or nothing when another worker holds the prune lock."""
    client = redis_client()
    lock = client.lock(PRUNE_LOCK_KEY, timeout=PRUNE_LOCK_TTL_S)
    if not lock.acquire(blocking=False):
        return {"skipped": "another prune is running"}
    try:
        result = run_prune()
        return {"cards": list(result.cards), "decisions": result.decisions}
    finally:
        with contextlib.suppress(redis.RedisError):
            lock.release()


@dataclass(frozen=True, slots=True)
class PruneResult:
    cards: tuple[str, ...]  # UUIDs of the cards deleted
    decisions: int  # decision log entries deleted


def run_prune(now: datetime | None = None) -> PruneResult:
    """Delete cards long missing that nothing holds, decision log entries past their use and
    expired sessions, each through its owner (the ledger's services; Django's session store)."""
    now = now or timezone.now()
    cards = nodes.prune_missing_cards(services.SYSTEM, now=now)
    pruned_decisions = decisions.prune_decisions(now=now)
    # Every visitor of the sign-in page has a session (its CSRF token lives there): drop the
    # expired ones, as `manage.py clearsessions` would.
    with contextlib.suppress(NotImplementedError):  # a store that expires by itself
        import_module(settings.SESSION_ENGINE).SessionStore.clear_expired()
    if cards or pruned_decisions:
        log.info(
            "prune: %d card(s) long missing (%s), %d decision log entries",
            len(cards),
            ", ".join(c.uuid for c in cards[:10]) + (", ..." if len(cards) > 10 else ""),
            pruned_decisions,
        )
    return PruneResult(tuple(c.uuid for c in cards), pruned_decisions)


class StateStore(Protocol):
    """Where the reconciler keeps its resume point (Redis in production, a dict in-process)."""

    def get(self, key: str) -> str | None: ...

    def set(self, key: str, value: str) -> None: ...


class RedisState:
    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def get(self, key: str) -> str | None:
        value = self.client.get(key)
        return value.decode() if isinstance(value, bytes) else value  # type: ignore[return-value]

    def set(self, key: str, value: str) -> None:
        self.client.set(key, value, ex=86400)


class LocalState(dict[str, str]):
    def set(self, key: str, value: str) -> None:
        self[key] = value


def resume_point(cluster: str, rv: str) -> str:
    """The stored form of a resume point: the resourceVersion and the cluster that issued it."""
    return json.dumps({"cluster": cluster, "rv": rv})


def _saved_resume_point(state: StateStore, key: str = RESUME_KEY) -> tuple[str, str] | None:
    """(cluster, resourceVersion) saved by the last pass; None when there is none or it is not
    one (a value of an older format is simply not a resume point: one relist)."""
    raw = state.get(key)
    try:
        saved = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not isinstance(saved, dict) or not saved.get("rv"):
        return None
    return str(saved.get("cluster") or ""), str(saved["rv"])


def _ahead(saved: str, current: str) -> bool:
    """Is the saved resourceVersion past the API server's? (Both are etcd revisions in every
    API server there is; anything else is not compared.)"""
    return saved.isdigit() and current.isdigit() and int(saved) > int(current)


class _HasUid(Protocol):
    @property
    def uid(self) -> str: ...


Watched = TypeVar("Watched", bound=_HasUid)


def net_changes(events: Iterable[tuple[str, Watched]]) -> tuple[dict[str, Watched], set[str]]:
    """What a watch's events come to: the objects as last seen, by UID, and the UIDs deleted
    (a deletion followed by a re-creation under the same UID counts as seen)."""
    seen: dict[str, Watched] = {}
    deleted: set[str] = set()
    for kind, obj in events:
        if kind == "DELETED":
            deleted.add(obj.uid)
            seen.pop(obj.uid, None)
        else:
            seen[obj.uid] = obj
            deleted.discard(obj.uid)
    return seen, deleted


def _reconcile_claims(
    source: ClusterSource, state: StateStore, cluster: str, *, full: bool
) -> Counter[str]:
    """DRA mode: mirror the cluster's ResourceClaims into the ledger (`claims`), from a watch
    of claim events since the claims' own resume point, or a full list (on a full pass, without
    a resume point of this cluster, or when the watch cannot resume)."""
    saved = _saved_resume_point(state, CLAIMS_RESUME_KEY)
    rv = saved[1] if saved and saved[0] == cluster else None
    drift: Counter[str] = Counter()
    if not full and rv:
        try:
            events = source.watch_claims(rv, CLAIMS_WATCH_S)
            seen, deleted = net_changes((e.kind, e.claim) for e in events)
            drift += claims.reconcile_claims(
                seen.values(),
                _devices_for(source, seen.values()),
                listed_at=timezone.now(),
                complete=False,
                deleted_uids=deleted,
            )
            state.set(
                CLAIMS_RESUME_KEY, resume_point(cluster, source.last_claims_resource_version())
            )
            return drift
        except WatchExpired:
            drift["claims_watch_expired"] += 1
    listed_at = timezone.now()
    listed, new_rv = source.list_claims(settings.TESSERA["LIST_PAGE_SIZE"])
    drift += claims.reconcile_claims(
        listed, _devices_for(source, listed), listed_at=listed_at, complete=True
    )
    state.set(CLAIMS_RESUME_KEY, resume_point(cluster, new_rv))
    return drift


def _devices_for(source: ClusterSource, listed: Any) -> Any:
    """The published devices, read only when one of the claims holds one of Tessera's."""
    wanted = any(r.driver == DRA_DRIVER for c in listed if c.allocated for r in c.results)
    return source.published_devices() if wanted else {}


def run_reconcile(source: ClusterSource, state: StateStore, *, full: bool) -> ReconcileRun:
    """A full relist or a watch pass, then node staleness; records a ReconcileRun.

    Losing `state` (Redis restarted) costs one full relist, nothing else: every repair is
    level-based and committed on its own.
    """
    started = time.monotonic()
    run = ReconcileRun(started_at=timezone.now(), mode=ReconcileRun.Mode.WATCH)
    drift: Counter[str] = Counter()
    verify = verify_allocation
    cluster = source.cluster_identity()
    saved = _saved_resume_point(state)
    rv = saved[1] if saved else None
    if saved and saved[0] != cluster:
        # Redis outlived the cluster (replaced, or its etcd swapped for another): this version
        # is another store's counter, and a watch from it would hide every event until it got
        # there, or start past events it never saw. Only a relist is right.
        log.warning(
            "reconcile: resume point %s was saved on another cluster (%s, now %s): relisting",
            rv,
            saved[0] or "unknown",
            cluster or "unknown",
        )
        drift["resume_point_other_cluster"] += 1
        rv = None
    last_full = float(state.get(LAST_FULL_KEY) or 0)
    if time.time() - last_full > settings.TESSERA["FULL_RESYNC_S"]:
        full = True
    if not full and rv and _ahead(rv, source.current_resource_version()):
        # etcd restored from a backup: the API server would watch from this version in
        # silence until it got there. Only a relist is right.
        log.warning("reconcile: resume point %s is ahead of the API server: relisting", rv)
        drift["resume_point_ahead"] += 1
        full = True
    if not full and rv:
        try:
            events = source.watch_pods(rv, settings.TESSERA["WATCH_TIMEOUT_S"])
            seen, deleted = net_changes((e.kind, e.pod) for e in events)
            # Deadlines pass without any event: look up the pods of expired reservations too.
            for expired in expired_reservations(timezone.now()):
                if expired.pod_uid in seen:
                    continue
                pod = source.get_pod(expired.namespace, expired.name)
                if pod is None or pod.uid != expired.pod_uid:  # gone, or a newer namesake
                    deleted.add(expired.pod_uid)
                else:
                    seen[pod.uid] = pod
            drift += services.reconcile_pods(
                seen.values(),
                listed_at=timezone.now(),
                complete=False,
                verify=verify,
                deleted_uids=deleted,
            )
            if deleted:
                decisions.forget_decisions(deleted, before=timezone.now())
            run.pods_seen = len(seen) + len(deleted)
            state.set(RESUME_KEY, resume_point(cluster, source.last_resource_version()))
        except WatchExpired:
            drift["watch_expired"] += 1
            full = True
    if full or not rv:
        run.mode = ReconcileRun.Mode.FULL
        listed_at = timezone.now()
        pods, new_rv = source.list_pods(settings.TESSERA["LIST_PAGE_SIZE"])
        drift += services.reconcile_pods(pods, listed_at=listed_at, complete=True, verify=verify)
        # "Why pending?" entries of pods that are gone (deleted while pending) stop counting as
        # pending now, not when they age out.
        gone = decided_pod_uids(listed_at) - {pod.uid for pod in pods}
        if gone:
            decisions.forget_decisions(gone, before=listed_at)
        cluster_nodes = source.list_node_names()
        drift["nodes_deleted"] += nodes.mark_deleted_nodes(cluster_nodes, services.SYSTEM)
        run.pods_seen, run.nodes_seen = len(pods), len(cluster_nodes)
        state.set(RESUME_KEY, resume_point(cluster, new_rv))
        state.set(LAST_FULL_KEY, str(time.time()))
    if settings.TESSERA["MODE"] == "dra":
        try:
            drift += _reconcile_claims(
                source, state, cluster, full=run.mode == ReconcileRun.Mode.FULL
            )
        except ClaimsUnreadable as exc:
            # The pods' repairs above are done; claims wait for the grant (the chart's worker
            # role has it in DRA mode), and each pass says so.
            log.warning("reconcile: claims are not mirrored: %s", exc)
            drift["claims_unreadable"] += 1
    drift["nodes_stale"] += nodes.mark_stale_nodes(services.SYSTEM)
    # A drained card whose pending mode change the release path missed (a worker died between
    # the release's commit and the change) gets it here.
    drift["card_modes_applied"] += len(modes.apply_pending_modes())
    run.drift = {k: v for k, v in drift.items() if v}
    run.finished_at = timezone.now()
    run.duration_ms = int((time.monotonic() - started) * 1000)
    run.save()
    # Keep a week of runs: /metrics sums the last day's drift, the dashboard shows recent runs.
    ReconcileRun.objects.filter(started_at__lt=run.started_at - timedelta(days=7)).delete()
    if run.drift:
        log.info("reconcile (%s): repaired %s", run.mode, run.drift)
    return run
