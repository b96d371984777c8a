"""Tessera's own preemption: room for a pod that is unschedulable for want of GPU slices.

kube-scheduler cannot start it (docs/preemption.md), so the extender's filter hands each GPU pod
it found no node for to `preemptor.consider`, and one background worker per process
(`controlplane.background`) does the rest, off the filter's path:

1. choose, over the nodes kube-scheduler offered, the node whose victims rank best
   (`choose_victims`: fewest pods, lowest priorities, newest; within PodDisruptionBudgets);
2. hold the room for the pod in the ledger (a nomination, under the node lock) before anything
   is evicted, so that no other pod takes it meanwhile;
3. evict the victims through the Eviction API (a budget's 429 gives the hold up), tell the
   victims and the pod (Events), set the pod's `nominatedNodeName`;
4. wait for the victims to be gone, release their slices, and touch the pod so kube-scheduler
   tries it again at once rather than at its next periodic retry.

A pod is considered again no sooner than `RETRY_S` after its last try, and never while its
preemption is under way; a pod with `preemptionPolicy: Never` never preempts. Safe with several
replicas: the nomination is one ledger row per pod, written under the node's lock, and
evicting an already-evicted pod is a no-op.

The other pieces of preemption are mapped in `controlplane.extender.preemption`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connections
from django.utils import timezone

from controlplane.background import Worker
from controlplane.kube import adapter, events
from controlplane.kube.base import Kube, KubeError
from controlplane.ledger import preemption
from controlplane.ledger.services import bindings, decisions, nominations
from controlplane.scheduling import NodeState, PodRequest, claims_per_card, place_on_node
from controlplane.scheduling.preempt import Candidate, NoVictims, Victims, choose_victims

log = logging.getLogger(__name__)

RETRY_S = 10.0  # a pod's next try after one that changed nothing
HOLD_S = 60.0  # how long room is held past the victims' grace periods
DEFAULT_GRACE_S = 30  # a pod's terminationGracePeriodSeconds when it does not say
POLL_S = 0.5  # how often the victims are looked for while they terminate
HELD_TTL_S = 1.0  # how stale the filter's view of the holds may be
# How stale the lowest priority among slice holders may be: below it no pod can preempt, and
# a cluster without PriorityClasses (every pod at 0) never pays for a try.
LOWEST_TTL_S = 5.0
MAX_QUEUED = 1000

NOMINATED_ANNOTATION = "tessera.io/nominated-node"
FREED_ANNOTATION = "tessera.io/room-freed"  # when the victims were gone and their slices freed
PREEMPTED = "Preempted"
PREEMPTING = "Preempting"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one try did: `kind` is one of fits, never, none, blocked, nominated, in_progress."""

    kind: str
    message: str
    node: str = ""
    pods: tuple[Candidate, ...] = ()  # the victims, as chosen
    until: str = ""
    grace_s: int = 0  # the victims' longest termination grace period

    @property
    def victims(self) -> tuple[str, ...]:
        """The victims as namespace/name."""
        return tuple(p.key for p in self.pods)


@dataclass(slots=True)
class _Budgets:
    """PodDisruptionBudgets over the candidates: who is covered by which, and how many each
    allows now."""

    of: dict[str, str] = field(default_factory=dict)  # pod UID -> "namespace/name"
    allowed: dict[str, int] = field(default_factory=dict)


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A policy/v1 label selector against a pod's labels: null matches nothing, {} everything."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        present = key in labels
        if op == "In" and not (present and labels[key] in values):
            return False
        if op == "NotIn" and present and labels[key] in values:
            return False
        if op == "Exists" and not present:
            return False
        if op == "DoesNotExist" and present:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            return False  # an operator this does not know protects rather than exposes
    return True


def _budgets(kube: Kube, pods: Iterable[Candidate]) -> _Budgets:
    found = _Budgets()
    by_namespace: dict[str, list[Candidate]] = {}
    for pod in pods:
        by_namespace.setdefault(pod.namespace, []).append(pod)
    for namespace, members in by_namespace.items():
        budgets = kube.list_disruption_budgets(namespace)
        if not budgets:
            continue
        labels = {
            p.get("metadata", {}).get("uid"): p.get("metadata", {}).get("labels") or {}
            for p in kube.list_pods(namespace)
        }
        for budget in budgets:
            meta = budget.get("metadata", {})
            name = f"{namespace}/{meta.get('name')}"
            found.allowed[name] = int((budget.get("status") or {}).get("disruptionsAllowed") or 0)
            selector = (budget.get("spec") or {}).get("selector")
            for pod in members:
                if pod.uid not in found.of and selector_matches(selector, labels.get(pod.uid, {})):
                    found.of[pod.uid] = name
    return found


def _with_budget(pods: Sequence[Candidate], budgets: _Budgets) -> list[Candidate]:
    return [
        p if p.uid not in budgets.of else Candidate(
            p.uid, p.namespace, p.name, p.priority, p.started, p.claims, budgets.of[p.uid]
        )
        for p in pods
    ]  # fmt: skip


def _grace(kube: Kube, victims: Sequence[Candidate]) -> int:
    longest = 0
    for v in victims:
        pod = kube.get_pod(v.namespace, v.name) or {}
        grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
        longest = max(longest, int(grace) if isinstance(grace, int) else DEFAULT_GRACE_S)
    return longest


def _gone(kube: Kube, victim: Candidate) -> bool:
    pod = kube.get_pod(victim.namespace, victim.name)
    return pod is None or (pod.get("metadata") or {}).get("uid") != victim.uid


Known = dict[str, tuple[NodeState, list[Candidate]]]


def decide(
    request: PodRequest, node_names: Sequence[str], kube: Kube
) -> tuple[Victims | None, list[NoVictims], Known]:
    """The best node's victims (None: no node works), why each other node did not, and the
    nodes as read (state, pods)."""
    known = preemption.nodes_with_pods(node_names)
    everyone = [p for _, pods in known.values() for p in pods if p.priority < request.pod_priority]
    budgets = _budgets(kube, everyone) if everyone else _Budgets()
    best: Victims | None = None
    refused: list[NoVictims] = []
    for name in sorted(known):
        node, pods = known[name]
        pods = _with_budget(pods, budgets)
        chosen = choose_victims(
            node, request, pods, priority=request.pod_priority, budgets=budgets.allowed
        )
        if isinstance(chosen, NoVictims):
            refused.append(chosen)
        elif best is None or (chosen.rank, chosen.node) < (best.rank, best.node):
            best = chosen
    return best, refused, known


def preempt(request: PodRequest, node_names: Sequence[str], kube: Kube) -> Outcome:
    """One try for the pod: decide, hold, evict, tell (steps 1-3 of the module doc)."""
    who = f"{request.namespace}/{request.name}"
    if request.preempt_never:
        return Outcome("never", f"{who} has preemptionPolicy Never")
    held = preemption.held_nodes([request.uid])
    if held:
        return Outcome("in_progress", f"room is already held for {who} on {held[request.uid]}")
    best, refused, known = decide(request, node_names, kube)
    if best is None:
        reasons = "; ".join(f"{r.node}: {r.reason}" for r in refused[:5]) or "no candidate node"
        return Outcome("none", f"no node can make room for {who} by preemption ({reasons})")
    if not best.pods:
        return Outcome("fits", f"{who} fits on {best.node} without preemption", best.node)
    node, pods = known[best.node]
    leaving = {p.uid for p in best.pods}
    staying = [p for p in pods if p.uid not in leaving]
    exclusive = frozenset(u for p in staying for u, c in p.claims.items() if c.exclusive)
    placed = place_on_node(node.without_claims([p.claims for p in best.pods], exclusive), request)
    if not isinstance(placed, tuple):
        return Outcome("none", f"{who} no longer fits on {best.node} after preemption")
    victims = tuple(p.key for p in best.pods)
    grace = _grace(kube, best.pods)
    deadline = timezone.now() + timedelta(seconds=grace + HOLD_S)
    nominations.nominate(
        pod_uid=request.uid, namespace=request.namespace, name=request.name,
        node_name=best.node, priority=request.pod_priority,
        claims=claims_per_card(a.to_claim() for a in placed), victims=victims, deadline=deadline,
    )  # fmt: skip
    for victim in best.pods:
        try:
            kube.evict_pod(victim.namespace, victim.name, victim.uid)
        except KubeError as exc:
            nominations.end_nominations([request.uid])
            kind = "blocked" if exc.status == 429 else "none"
            return Outcome(kind, f"evicting {victim.key} for {who} failed: {exc.message}")
        events.record(
            victim.namespace, victim.name, victim.uid, PREEMPTED,
            f"Preempted by {who} (priority {request.pod_priority}): its GPU slices on node "
            f"{best.node} are needed",
        )  # fmt: skip
    until = timezone.localtime(deadline).strftime("%H:%M:%S")
    message = f"preempting {', '.join(victims)} on node {best.node}; room held until {until}"
    events.record(request.namespace, request.name, request.uid, PREEMPTING, message)
    try:
        kube.nominate_pod(
            request.namespace, request.name, best.node, {NOMINATED_ANNOTATION: best.node}
        )
    except KubeError as exc:  # the hold stands: kube-scheduler finds the room when it retries
        log.warning("preemption for %s: setting nominatedNodeName failed: %s", who, exc.message)
    return Outcome("nominated", message, best.node, best.pods, until, grace)


def finish(request: PodRequest, outcome: Outcome, kube: Kube, *, sleep: Callable[[float], None]
           = time.sleep) -> bool:  # fmt: skip
    """Step 4: wait for the victims to be gone (until the hold's deadline), release their
    slices, and touch the pod. False when the victims outlived the hold."""
    victims = outcome.pods
    deadline = time.monotonic() + HOLD_S + max(DEFAULT_GRACE_S, outcome.grace_s)
    waiting = list(victims)
    while waiting and time.monotonic() < deadline:
        waiting = [v for v in waiting if not _gone(kube, v)]
        if waiting:
            sleep(POLL_S)
    if waiting:
        return False
    who = f"{request.namespace}/{request.name}"
    bindings.release_bindings([v.uid for v in victims], f"preempted by {who}", actor="system")
    touch = {NOMINATED_ANNOTATION: outcome.node, FREED_ANNOTATION: timezone.now().isoformat()}
    try:
        kube.nominate_pod(request.namespace, request.name, outcome.node, touch)
    except KubeError as exc:
        log.warning("preemption for %s: touching the pod failed: %s", who, exc.message)
    return True


class Preemptor:
    """One per process (`preemptor`): a queue and the worker that tries each pod on it, and the
    pods this process holds room for (so that their own filter sees that room free)."""

    def __init__(self) -> None:
        self._held: dict[str, str] | None = None  # pod UID -> node
        self._held_at = 0.0
        self._lowest: int | None = None  # lowest priority among slice holders
        self._lowest_at = -LOWEST_TTL_S
        self.worker: Worker[tuple[PodRequest, tuple[str, ...]]] = Worker(
            "tessera-preemptor", self._try_each, max_queued=MAX_QUEUED
        )
        self._tried: dict[str, float] = {}
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def held_node(self, pod_uid: str) -> str | None:
        """The node where room is held for the pod: from the ledger's holds, read at most once
        per `HELD_TTL_S` (the filter asks for every pod; a hold another process made is seen
        within that time, and a pod's filter meanwhile only misses room held for it)."""
        now = time.monotonic()
        held = self._held
        if held is None or now - self._held_at > HELD_TTL_S:
            held = self._held = preemption.held_nodes()
            self._held_at = now
        return held.get(pod_uid)

    def refresh(self) -> None:
        """Read the ledger's holds again at the next `held_node`."""
        self._held = None

    def forget(self, pod_uid: str) -> None:
        """The pod bound: its hold ended with its reservation."""
        if self._held is not None:
            self._held.pop(pod_uid, None)

    def consider(self, request: PodRequest, node_names: Sequence[str]) -> None:
        """Queue a try for a GPU pod the filter found no node for (cheap; never blocks)."""
        if request.preempt_never or not settings.TESSERA.get("PREEMPTION", True):
            return
        now = time.monotonic()
        lowest = self._lowest
        if now - self._lowest_at < LOWEST_TTL_S and (
            lowest is None or request.pod_priority <= lowest
        ):
            return  # no pod of lower priority holds slices: nothing to try
        with self._lock:
            if request.uid in self._busy or now - self._tried.get(request.uid, -RETRY_S) < RETRY_S:
                return
            self._busy.add(request.uid)
            self._tried[request.uid] = now
            if len(self._tried) > 4 * MAX_QUEUED:
                self._tried = {u: t for u, t in self._tried.items() if now - t < RETRY_S}
        if not self.worker.submit((request, tuple(node_names))):
            with self._lock:
                self._busy.discard(request.uid)

    def _try_each(self, batch: list[tuple[PodRequest, tuple[str, ...]]]) -> None:
        for request, names in batch:
            try:
                self.run_one(request, names, adapter.get_kube())
            except Exception:  # one pod's failure must not keep the others from their try
                log.exception("preemption for %s/%s failed", request.namespace, request.name)
            finally:
                connections.close_all()
                with self._lock:
                    self._busy.discard(request.uid)

    def run_one(self, request: PodRequest, names: Sequence[str], kube: Kube) -> Outcome:
        for uid in nominations.expire_nominations():
            self.forget(uid)
        if time.monotonic() - self._lowest_at >= LOWEST_TTL_S:
            self._lowest, self._lowest_at = preemption.lowest_priority(), time.monotonic()
        if self._lowest is None or request.pod_priority <= self._lowest:
            return Outcome("none", "no pod of lower priority holds slices")
        outcome = preempt(request, names, kube)
        if outcome.kind == "nominated":
            self.held_node(request.uid)  # loads the ledger's holds (this one among them)
            if self._held is not None:
                self._held[request.uid] = outcome.node
        log.info("preemption for %s/%s: %s", request.namespace, request.name, outcome.message)
        if outcome.kind in ("nominated", "none", "blocked"):
            decisions.note_preemption(request.uid, request.namespace, request.name, outcome.message)
        if outcome.kind == "nominated" and not finish(request, outcome, kube):
            decisions.note_preemption(
                request.uid,
                request.namespace,
                request.name,
                f"{outcome.message}; the victims outlived the hold",
            )
        return outcome


preemptor = Preemptor()
