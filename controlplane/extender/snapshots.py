"""A per-process cache of the cluster snapshot for filter and prioritize (DESIGN §1).

Only an accelerator: bind never reads it (it re-fits under the node lock on committed rows).
Filter and prioritize may see the ledger as it was up to about `FILTER_SNAPSHOT_TTL_MS` ago; a
wrong "feasible" then costs a refused bind and a retry by the scheduler, a wrong "infeasible" a
later retry.

Building a 1,000-node snapshot from scratch takes the ledger selector a good part of a second,
so the cache is kept fresh incrementally and off the request path:

- a background worker (`controlplane.background`), every TTL, re-reads only the nodes whose
  node, card or binding rows changed since its last pass (minus a margin for transactions that
  committed late) and swaps them in; when node or card counts drop (rows deleted) it rebuilds
  everything, and it does so anyway every `FULL_REFRESH_S`; a rebuild then catches up on what
  changed while it read;
- what this process has just reserved on a node is added to the cached node at once (the
  "assumed pod": no re-read), so its own binds show in the very next answer (the scheduler's
  sidecar is the only binder); a node whose bind was undone is marked dirty and re-read
  before the next answer. The incremental pass does not re-read a node for a binding row of
  a pod this process assumed that still holds its slices (reserved, bound, allocated: the
  claims it added are what the rows say); any other row change on the node (another
  writer's binding, a release, a card, the node itself) re-reads it. Without that, every
  bind's node was read back in each pass of the look-back window, most of the refresher's
  work during a burst;
- should the thread fall behind by more than `STALE_LIMIT_S`, the request refreshes itself.

`FILTER_SNAPSHOT_TTL_MS = 0` turns the cache off (each call reads the committed ledger).
`background = False` (tests) refreshes in the request instead of a thread.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connections
from django.utils import timezone

from controlplane.background import Worker
from controlplane.ledger import selectors
from controlplane.ledger.models import PodBinding
from controlplane.scheduling import CardClaim, NodeState, QuotaLimits, Snapshot

FULL_REFRESH_S = 600.0
STALE_LIMIT_S = 2.0
OWN_PODS = 65536  # pod UIDs this process assumed, remembered (oldest forgotten first)
# Rows stamped before a refresh began may commit after it read: look back this far. Ledger
# transactions last milliseconds; one second also absorbs small clock skew between replicas.
LATE_COMMIT_MARGIN = timedelta(seconds=1)


def _ttl() -> float:
    return float(settings.TESSERA.get("FILTER_SNAPSHOT_TTL_MS") or 0) / 1000.0


class SnapshotCache:
    """Thread-safe; one instance per process (`snapshot_cache`)."""

    def __init__(self, *, background: bool = True) -> None:
        self.background = background
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._cards = 0  # cards in the snapshot, to notice deletions
        self._synced_at = -math.inf  # monotonic time of the last refresh (-inf: never)
        # monotonic time of the last full rebuild; -inf: due now (not 0.0: the monotonic clock
        # starts near zero at boot, so for FULL_REFRESH_S after it 0.0 would not be due)
        self._full_at = -math.inf
        self._cursor: datetime | None = None  # wall time the last refresh started reading
        self._dirty: set[str] = set()
        self._read_at: dict[str, float] = {}  # node -> monotonic start of the read now installed
        self._refreshing = threading.Lock()  # one incremental pass at a time
        self._quotas: dict[str, QuotaLimits] = {}
        self._own: OrderedDict[str, None] = OrderedDict()  # pod UIDs assumed here
        self._passed_at = -math.inf  # monotonic end of the background refresher's last pass
        self.refresher: Worker[None] = Worker(
            "tessera-snapshot-refresh", self._pass, close=connections.close_all, due=self._due
        )
        self.refreshes = 0  # counters for tests and the bench
        self.full_rebuilds = 0

    def clear(self) -> None:
        with self._lock:
            self._snapshot, self._cursor, self._dirty = None, None, set()
            self._read_at = {}
            self._own.clear()

    def mark_dirty(self, node_names: Iterable[str]) -> None:
        """This process changed these nodes' rows: re-read them before the next answer."""
        self._dirty.update(node_names)

    def assume(self, node_name: str, claims: Mapping[str, CardClaim], pod_uid: str) -> None:
        """This process just reserved these claims on the node for the pod: add them to the
        cached node (kube-scheduler's "assumed pod") instead of re-reading it.

        Incremental passes then skip the pod's binding row while it holds its slices; a read
        that began before this call is older than the reservation and is not installed over it.
        """
        if self._snapshot is None or _ttl() <= 0:
            return
        with self._lock:
            node = self._snapshot.by_name.get(node_name)
            if node is None:
                self._dirty.add(node_name)
                return
            self._snapshot = self._snapshot.replacing({node_name: node.with_claims(claims)})
            self._read_at[node_name] = time.monotonic()
            self._own[pod_uid] = None
            if len(self._own) > OWN_PODS:
                self._own.popitem(last=False)

    def quota_limits(self, namespace: str) -> QuotaLimits | None:
        """The namespace's quota as of the snapshot (bind re-checks it under the lock)."""
        if _ttl() <= 0:
            return selectors.quota_limits(namespace)
        self.get()
        return self._quotas.get(namespace)

    def get(self) -> Snapshot:
        ttl = _ttl()
        if ttl <= 0:
            return selectors.cluster_snapshot()
        if self._snapshot is None:
            with self._lock:
                if self._snapshot is None:
                    self._install_full(self._read_full())
                    self._passed_at = time.monotonic()
                    self.refresher.wake()  # its first pass is due a TTL from now
        if self.background:
            self.refresher.start()
        overdue = time.monotonic() - self._synced_at >= (STALE_LIMIT_S if self.background else ttl)
        if self._dirty or overdue:
            # Reads happen outside the lock; installing a read is short. Our own binds (dirty
            # nodes) are always re-read; an overdue incremental pass runs in one thread only.
            incremental = overdue and self._refreshing.acquire(blocking=False)
            try:
                self._install(self._read_changes(incremental=incremental))
            finally:
                if incremental:
                    self._refreshing.release()
        return self._snapshot  # type: ignore[return-value]

    # --- refreshing: read without the lock, install under it ---------------------------------

    @staticmethod
    def _read_full() -> _Read:
        started, cursor = time.monotonic(), timezone.now()
        snapshot = selectors.cluster_snapshot()
        return _Read(started, cursor, {n.name: n for n in snapshot.nodes}, set(), True,
                     selectors.all_quota_limits(), None)  # fmt: skip

    def _install_full(self, read: _Read) -> None:
        """Replace everything, except nodes re-read after this read began (fresher)."""
        old = {n.name: n for n in self._snapshot.nodes} if self._snapshot else {}
        nodes = dict(read.nodes)
        for name, at in self._read_at.items():
            if at > read.started and name in old:
                nodes[name] = old[name]
        self._snapshot = Snapshot(tuple(nodes.values()))
        self._cards = sum(len(n.cards) for n in self._snapshot.nodes)
        self._cursor, self._synced_at, self._full_at = read.cursor, read.started, read.started
        self._quotas = read.quotas or {}
        self.full_rebuilds += 1

    def _read_changes(self, *, incremental: bool) -> _Read:
        """Re-read the dirty nodes and, with `incremental`, every node changed since the cursor."""
        started, cursor = time.monotonic(), timezone.now()
        names = set(self._dirty)
        self._dirty.difference_update(names)
        if incremental and self._cursor is not None:
            own, held = self._own, _HELD
            names.update(
                node
                for node, pod_uid, phase in selectors.changes_since(
                    self._cursor - LATE_COMMIT_MARGIN
                )
                if pod_uid is None or phase not in held or pod_uid not in own
            )
        nodes = {n.name: n for n in selectors.cluster_snapshot(names).nodes} if names else {}
        quotas = selectors.all_quota_limits() if incremental else None
        counts = selectors.ledger_counts() if incremental else None
        return _Read(started, cursor, nodes, names, incremental, quotas, counts)

    def _install(self, read: _Read) -> None:
        with self._lock:
            assert self._snapshot is not None
            if read.names:
                changes: dict[str, NodeState | None] = {}
                for name in read.names:
                    if self._read_at.get(name, 0.0) > read.started:
                        continue  # a later read of this node is already in
                    self._read_at[name] = read.started
                    old = self._snapshot.by_name.get(name)
                    self._cards -= len(old.cards) if old is not None else 0
                    changes[name] = read.nodes.get(name)  # None: deleted
                    self._cards += len(read.nodes[name].cards) if name in read.nodes else 0
                self._snapshot = self._snapshot.replacing(changes)
            if read.incremental:
                self._cursor, self._synced_at = read.cursor, read.started
                self._quotas = read.quotas or {}
                node_count, card_count = read.counts or (0, 0)
                if node_count < len(self._snapshot.nodes) or card_count < self._cards:
                    self._full_at = -math.inf  # rows were deleted: only a rebuild drops them
            self.refreshes += 1
        if read.incremental and not self.background and self._full_due():
            full = self._read_full()
            with self._lock:
                self._install_full(full)

    def _full_due(self) -> bool:
        return time.monotonic() - self._full_at >= FULL_REFRESH_S

    def _due(self) -> float | None:
        """Seconds until the refresher's next pass: a TTL after the end of its last one; None
        while there is no snapshot to keep fresh."""
        ttl = _ttl()
        if self._snapshot is None or not self.background or ttl <= 0:
            return None
        return self._passed_at + ttl - time.monotonic()

    def _pass(self, _nothing: list[None]) -> None:
        """The background refresher's pass: incremental, after a full rebuild when one is due.
        Should it fail, the request path refreshes itself once the snapshot is `STALE_LIMIT_S`
        old, and the next pass comes a TTL later."""
        try:
            if self._snapshot is None:
                return
            with self._refreshing:
                if self._full_due():
                    full = self._read_full()
                    with self._lock:
                        self._install_full(full)
                # after a rebuild this catches up on what changed while it read
                self._install(self._read_changes(incremental=True))
        finally:
            self._passed_at = time.monotonic()


@dataclass(frozen=True, slots=True)
class _Read:
    """What one refresh read from the ledger, to install under the lock."""

    started: float  # monotonic time the read began
    cursor: datetime  # wall time the read began (the next incremental pass starts here)
    nodes: dict[str, NodeState]
    names: set[str]  # nodes re-read (absent from `nodes` = deleted)
    incremental: bool
    quotas: dict[str, QuotaLimits] | None
    counts: tuple[int, int] | None


_HELD = frozenset(phase.value for phase in PodBinding.ACTIVE_PHASES)

snapshot_cache = SnapshotCache()
