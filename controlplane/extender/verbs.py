"""The extender's verbs filter, prioritize and bind, between the wire format and the ledger
(DESIGN §4); the fourth, preempt, is `controlplane/extender/preemption/verb.py`.

- filter: every feasible node (scoring is the scheduler's job), the rest with the core's reason
  per node; permanent refusals go to FailedAndUnresolvableNodes. Reads the cached snapshot.
- prioritize: 0..10 per node by the pod's node policy. Reads the cached snapshot.
- bind: the authoritative step (`run_bind`). The ledger's `bind_pod` reserves (lock -> re-fit on
  committed rows -> write -> commit), then the Binding goes through the Kubernetes adapter with
  the signed allocation as annotations; the reservation is undone when the API server refused,
  confirmed when it accepted.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.utils import timezone

from controlplane.extender import summary as filter_summary
from controlplane.extender.decision_writer import record as record_decision
from controlplane.extender.decision_writer import record_bind as record_bind_outcome
from controlplane.extender.decision_writer import record_bound
from controlplane.extender.preemption.preemptor import preemptor
from controlplane.extender.snapshots import snapshot_cache
from controlplane.extender.wire import BindingArgs, ExtenderArgs
from controlplane.kube import adapter, events
from controlplane.kube.base import Kube, KubeError
from controlplane.ledger import allocation, selectors, usage
from controlplane.ledger.errors import AlreadyPlaced, ServiceError
from controlplane.ledger.services import bindings
from controlplane.ledger.services.bindings import Reservation
from controlplane.ledger.services.confirmations import confirm_later
from controlplane.ledger.services.decisions import DecisionRecord, Outcome
from controlplane.scheduling import (
    PodRequest,
    QuotaUsage,
    ReasonCode,
    RequestError,
    Snapshot,
    check_quota,
    filter_nodes,
    least_demand,
    parse_pod,
    prioritize,
)

log = logging.getLogger(__name__)


# --- the pods filter saw ------------------------------------------------------------------------


class RecentRequests:
    """The parsed GPU request of the pods filter saw lately, by pod UID (bounded, per process).

    kube-scheduler sends the whole pod to filter; bind gets only its name, namespace and UID.
    Remembering the request saves bind reading the pod back from the API server: one API call
    of two, on the path that holds a request thread while the API server works. A pod's
    resource requests cannot change while it is unscheduled, and a pod replaced under the same
    name has a new UID (the Binding's UID precondition refuses the old one), so the entry is
    as good as a fresh read. A pod filter did not see (another replica's, a restart) is read.
    """

    def __init__(self, size: int = 8192) -> None:
        self._size = size
        self._items: OrderedDict[str, PodRequest | None] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, uid: str, request: PodRequest | None) -> None:
        with self._lock:
            self._items[uid] = request
            self._items.move_to_end(uid)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def recall(self, uid: str, namespace: str, name: str) -> tuple[bool, PodRequest | None]:
        """(known, request): request None for a known pod that asks for no managed resource.
        A UID remembered for another pod's name is not known (read or parse it afresh)."""
        with self._lock:
            if uid not in self._items:
                return False, None
            request = self._items[uid]
        if request is not None and (request.namespace, request.name) != (namespace, name):
            return False, None
        return True, request

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


recent_requests = RecentRequests()


# --- filter --------------------------------------------------------------------------------------


@dataclass(slots=True)
class FilterAnswer:
    feasible: list[str]
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    managed: bool = True


def _pod_identity(pod: dict[str, Any]) -> tuple[str, str, str]:
    meta = pod.get("metadata") if isinstance(pod.get("metadata"), dict) else {}
    namespace = str(meta.get("namespace") or "default")
    name = str(meta.get("name") or meta.get("generateName") or "")
    uid = str(meta.get("uid") or f"{namespace}/{name}")
    return uid, namespace, name


def _min_demand(request: PodRequest, snapshot: Snapshot, names: list[str]) -> QuotaUsage:
    """A lower bound of what any placement of the pod counts against its quota (the core's
    `least_demand`: the pod at its peak, sidecars included), with percentage and whole-card
    asks counted on the smallest card among the candidate nodes."""
    smallest = min(
        (c.memory_mib for n in names if (s := snapshot.by_name.get(n)) for c in s.cards),
        default=1,
    )
    return least_demand(request, smallest)


def run_filter(args: ExtenderArgs) -> FilterAnswer:
    """Split the scheduler's candidate nodes for the pod; record the decision when it is ours."""
    uid, namespace, name = _pod_identity(args.pod)
    try:
        request = parse_pod(args.pod, selectors.scheduling_config())
    except RequestError as exc:
        message = f"the pod's GPU request is invalid: {exc}"
        answer = FilterAnswer([], {}, dict.fromkeys(args.node_names, message))
        record_decision(
            DecisionRecord(
                uid, namespace, name, Outcome.INVALID, message, (), {},
                {"InvalidRequest": len(args.node_names)}, len(args.node_names),
            )
        )  # fmt: skip
        return answer
    meta = args.pod.get("metadata") if isinstance(args.pod.get("metadata"), dict) else {}
    if meta.get("uid"):
        recent_requests.remember(str(meta["uid"]), request)
    if request is None:
        return FilterAnswer(list(args.node_names), managed=False)

    snapshot = snapshot_cache.get()
    names = args.node_names
    if settings.TESSERA.get("PREEMPTION", True):
        held = preemptor.held_node(request.uid)
        if held is not None and held in snapshot.by_name:
            # Room held for this pod by its preemption is free for it alone.
            own = selectors.cluster_snapshot([held], for_pod=request.uid).by_name.get(held)
            snapshot = snapshot.replacing({held: own})
    limits = snapshot_cache.quota_limits(request.namespace)
    if limits is not None:
        refusal = check_quota(
            request.namespace,
            limits,
            usage.quota_usage(request.namespace),
            _min_demand(request, snapshot, names),
        )
        if refusal is not None:
            target = {} if refusal.permanent else None
            answer = FilterAnswer([])
            (answer.unresolvable if target is not None else answer.failed).update(
                dict.fromkeys(names, refusal.message)
            )
            record_decision(
                DecisionRecord(
                    uid, namespace, name, Outcome.UNSCHEDULABLE,
                    f"0 of {len(names)} nodes can hold it: {refusal.message}.",
                    (), {}, {ReasonCode.QUOTA_EXCEEDED.value: len(names)}, len(names),
                )
            )  # fmt: skip
            return answer

    feasible, fits = filter_nodes(snapshot, request, names)
    answer = FilterAnswer(feasible)
    counts: Counter[str] = Counter()
    largest_free: int | None = None
    for fit in fits:
        refusals = fit.refusals
        code = refusals[0].code.value
        counts[code] += 1
        (answer.unresolvable if fit.permanent else answer.failed)[fit.node] = fit.summary()
        if code == ReasonCode.INSUFFICIENT_MEMORY:
            node = snapshot.by_name.get(fit.node)
            if node is not None and node.view.n:
                free = max(node.view.max_fmem, 0)
                largest_free = free if largest_free is None else max(largest_free, free)
    summary = filter_summary.sentence(
        len(names),
        len(feasible),
        counts,
        need=filter_summary.memory_need(request),
        largest_free_mib=largest_free,
    )
    reasons = {**answer.failed, **answer.unresolvable}
    if not feasible:
        preemptor.consider(request, names)
    record_decision(
        DecisionRecord(
            uid,
            namespace,
            name,
            Outcome.FEASIBLE if feasible else Outcome.UNSCHEDULABLE,
            summary,
            feasible,
            reasons,
            dict(counts),
            len(names),
        )
    )
    return answer


# --- prioritize ----------------------------------------------------------------------------------


def run_prioritize(args: ExtenderArgs) -> list[tuple[str, int]]:
    """(node, score 0..10) in input order; 0 for every node when the pod is not ours.

    The request is the one filter parsed for the same pod in the same scheduling cycle
    (`RecentRequests`, by UID, name checked); a pod filter did not see here is parsed.
    Raises RequestError for a pod whose GPU request does not parse.
    """
    uid, namespace, name = _pod_identity(args.pod)
    known, request = recent_requests.recall(uid, namespace, name)
    if not known:
        request = parse_pod(args.pod, selectors.scheduling_config())
    if request is None:
        return [(n, 0) for n in args.node_names]
    return prioritize(snapshot_cache.get(), request, args.node_names)


# --- bind ----------------------------------------------------------------------------------------


# The reasons of the events bind records on the pod (`kubectl describe pod`).
ALLOCATED = "Allocated"
ALLOCATION_FAILED = "AllocationFailed"


class BindFailed(Exception):
    """Bind did not happen; `message` is for the scheduler's Error (and the pod's events)."""

    def __init__(self, message: str, outcome: str = "refused") -> None:
        super().__init__(message)
        self.message = message
        self.outcome = outcome  # metric label: refused | apiserver_error | invalid | conflict


@dataclass(frozen=True, slots=True)
class BindAnswer:
    outcome: str  # bound | already_bound | plain
    reservation: Reservation | None


def run_bind(args: BindingArgs) -> BindAnswer:
    """Bind the pod, idempotent per pod UID; raises BindFailed with the reason.

    1. The pod's request: the one its filter parsed (`RecentRequests`), else the pod as the API
       server has it.
    2. `bind_pod`: the ledger's lock -> recompute -> write -> commit. A repeated bind gets the
       reservation it already made; its `send_binding` says whether the Binding still goes.
    3. The Binding through the API server, with the signed allocation as annotations. Refused:
       the reservation is undone. Outcome unknown: it is kept for the reconciler to settle.
    4. Accepted: the confirmation (reserved -> bound) is queued off this path, on a channel that
       retries until it is written (`confirmations`); the decision log is told.
    """
    kube = adapter.get_kube()
    request: PodRequest | BindAnswer | None
    known, request = recent_requests.recall(args.pod_uid, args.namespace, args.pod_name)
    if not known:
        request = _read_request(kube, args)
    if isinstance(request, BindAnswer):
        return request

    if request is None:  # not ours: a plain Binding, nothing in the ledger
        error = _call_binding(kube, args, {})
        if error is not None:
            raise BindFailed(error.message, "apiserver_error")
        return BindAnswer("plain", None)

    try:
        reservation = bindings.bind_pod(request, args.node)
    except AlreadyPlaced as exc:
        _tell_failed(args, exc.message)
        raise BindFailed(exc.message, "conflict") from None
    except ServiceError as exc:
        record_bind_outcome(
            args.pod_uid, args.namespace, args.pod_name, Outcome.BIND_FAILED, exc.message
        )
        _tell_failed(args, exc.message)
        raise BindFailed(exc.message, "refused") from None
    if not reservation.send_binding:
        return BindAnswer("already_bound", reservation)  # bound before: no second Binding
    if not reservation.repeat:
        snapshot_cache.assume(args.node, reservation.claims(), args.pod_uid)

    annotations = allocation.annotations(reservation.allocation())
    # The crash window: the reservation is committed, the Binding not yet sent. A process dying
    # here leaves a reservation with a deadline; the reconciler finds it (expired_reservations).
    error = _call_binding(kube, args, annotations)
    if error is not None:
        settled = error.applied is False or _bound_as_asked(kube, args, annotations) is False
        if settled:
            bindings.release_binding(args.pod_uid, f"Binding failed: {error.message}", failed=True)
            snapshot_cache.mark_dirty([args.node])
            message = f"the API server refused the Binding: {error.message}"
        else:
            message = (
                f"the Binding's outcome is unknown ({error.message}); the reservation is kept "
                "until the reconciler checks the pod"
            )
        record_bind_outcome(
            args.pod_uid, args.namespace, args.pod_name, Outcome.BIND_FAILED, message
        )
        _tell_failed(args, message)
        raise BindFailed(message, "apiserver_error")

    confirm_later(args.pod_uid, timezone.now())
    preemptor.forget(args.pod_uid)
    # "why" reads the binding itself, so the filter's held decision is dropped unwritten.
    record_bound(args.pod_uid)
    events.record(
        args.namespace, args.pod_name, args.pod_uid, ALLOCATED, allocated_message(reservation)
    )
    return BindAnswer("bound", reservation)


def allocated_message(reservation: Reservation) -> str:
    """What the pod got, for its `Allocated` event: per container its cards, memory, compute.

    "node n1: warmup (init): card 0 GPU-1a2b 2000 MiB 30% compute; app: card 1 ...", init
    containers first, each container's cards in the order it sees them.
    """
    containers = sorted(reservation.containers(), key=lambda c: (not c.init, c.index))
    said = []
    for c in containers:
        cards = ", ".join(
            f"card {d.card_index} {d.uuid} {d.memory_mib} MiB "
            + (f"{d.cores}% compute" if d.cores else "compute not limited")
            for d in allocation.in_visible_order(c.devices)
        )
        said.append(f"{c.name}{' (init)' if c.init else ''}: {cards}")
    return f"node {reservation.node}: {'; '.join(said)}"


def _tell_failed(args: BindingArgs, message: str) -> None:
    events.record(
        args.namespace, args.pod_name, args.pod_uid, ALLOCATION_FAILED,
        f"node {args.node}: {message}", events.WARNING,
    )  # fmt: skip


def _bound_as_asked(kube: Kube, args: BindingArgs, annotations: dict[str, str]) -> bool | None:
    """After a failed Binding call: is the pod bound to our node with our allocation anyway?

    True: yes (an earlier attempt, or the call succeeded before the error). False: certainly not
    (unbound, bound elsewhere, gone or replaced). None: cannot tell (the API server is away).
    """
    try:
        pod = kube.get_pod(args.namespace, args.pod_name)
    except KubeError:
        return None
    if pod is None:
        return False
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if meta.get("uid") != args.pod_uid or spec.get("nodeName") != args.node:
        return False
    have = meta.get("annotations") or {}
    return all(have.get(k) == v for k, v in annotations.items())


def _call_binding(kube: Kube, args: BindingArgs, annotations: dict[str, str]) -> KubeError | None:
    """The Binding POST; None when the pod ends up bound as asked."""
    try:
        kube.bind_pod(args.namespace, args.pod_name, args.pod_uid, args.node, annotations)
    except KubeError as exc:
        # 409 "already assigned" is our own earlier attempt when the pod carries our allocation.
        if _bound_as_asked(kube, args, annotations):
            return None
        return exc
    return None


def _read_request(kube: Kube, args: BindingArgs) -> PodRequest | BindAnswer | None:
    """The pod's request read from the API server (a pod filter did not see here). A pod that
    is gone or replaced can only be a bind repeated after this extender bound it: the same
    answer again when the ledger says so. Raises BindFailed."""
    try:
        pod = kube.get_pod(args.namespace, args.pod_name)
    except KubeError as exc:
        raise BindFailed(
            f"cannot read the pod from the API server: {exc.message}", "apiserver_error"
        ) from None
    meta = (pod or {}).get("metadata") or {}
    if pod is None or meta.get("uid") != args.pod_uid:
        try:
            earlier = bindings.held_reservation(args.pod_uid, args.node)
        except AlreadyPlaced as exc:
            raise BindFailed(exc.message, "conflict") from None
        if earlier is not None and not earlier.send_binding:
            return BindAnswer("already_bound", earlier)
    if pod is None:
        raise BindFailed(f"pod {args.namespace}/{args.pod_name} does not exist", "invalid")
    if meta.get("uid") != args.pod_uid:
        raise BindFailed(
            f"pod {args.namespace}/{args.pod_name} has UID {meta.get('uid')}, not "
            f"{args.pod_uid}: the pod the scheduler placed was deleted and replaced",
            "invalid",
        )
    try:
        return parse_pod(pod, selectors.scheduling_config())
    except RequestError as exc:
        raise BindFailed(f"the pod's GPU request is invalid: {exc}", "invalid") from None
