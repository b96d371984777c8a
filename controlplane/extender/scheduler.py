"""The extender's three verbs, between the wire format and the ledger (DESIGN §4).

- filter: every feasible node (scoring is the scheduler's job), the rest with the core's reason
  per node; permanent refusals go to FailedAndUnresolvableNodes. Reads the cached snapshot.
- prioritize: 0..10 per node by the pod's node policy. Reads the cached snapshot.
- bind: the authoritative step. Reserve in the ledger (lock -> re-fit on committed rows ->
  write), then the Binding through the Kubernetes adapter with the signed allocation as
  annotations; undo the reservation when the API server refused, confirm it when it accepted.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from django.utils import timezone

from controlplane.extender import selectors as ext_selectors
from controlplane.extender import signing, why
from controlplane.extender.decisions import record as record_decision
from controlplane.extender.decisions import record_bind as record_bind_outcome
from controlplane.extender.decisions import record_bound
from controlplane.extender.services import DecisionRecord, Outcome
from controlplane.extender.snapshots import snapshot_cache
from controlplane.extender.wire import BindingArgs, ExtenderArgs
from controlplane.kube import adapter
from controlplane.kube.base import Kube, KubeError
from controlplane.ledger import selectors, services
from controlplane.ledger.models import PodBinding
from controlplane.scheduling import (
    CardClaim,
    PodRequest,
    QuotaUsage,
    ReasonCode,
    RequestError,
    SliceClaim,
    Snapshot,
    check_quota,
    claims_per_card,
    filter_nodes,
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
    """A lower bound of what any placement of the pod counts against its quota.

    Init containers may share cards with app slices (the claim is the larger of the two), so
    the bound is max(app total, largest init container); a percentage or whole-card ask is
    counted on the smallest card among the candidate nodes.
    """
    smallest = min(
        (c.memory_mib for n in names if (s := snapshot.by_name.get(n)) for c in s.cards),
        default=1,
    )

    def memory(c: Any) -> int:
        return c.memory_on(smallest) * c.gpus

    apps = [c for c in request.containers if not c.init]
    inits = [c for c in request.containers if c.init]
    return QuotaUsage(
        memory_mib=max(sum(map(memory, apps)), max(map(memory, inits), default=0)),
        cores=max(
            sum(c.cores * c.gpus for c in apps), max((c.cores * c.gpus for c in inits), default=0)
        ),
        gpus=max(sum(c.gpus for c in apps), max((c.gpus for c in inits), default=0)),
    )


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
    limits = snapshot_cache.quota_limits(request.namespace)
    if limits is not None:
        refusal = check_quota(
            request.namespace,
            limits,
            selectors.namespace_usage(request.namespace),
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
    summary = why.filter_summary(
        len(names),
        len(feasible),
        counts,
        need=why.memory_need(request),
        largest_free_mib=largest_free,
    )
    reasons = {**answer.failed, **answer.unresolvable}
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


class BindFailed(Exception):
    """Bind did not happen; `message` is for the scheduler's Error (and the pod's events)."""

    def __init__(self, message: str, outcome: str = "refused") -> None:
        super().__init__(message)
        self.message = message
        self.outcome = outcome  # metric label: refused | apiserver_error | invalid | conflict


@dataclass(frozen=True, slots=True)
class BindAnswer:
    outcome: str  # bound | already_bound | plain
    binding: PodBinding | None


def _bound_as_asked(
    kube: Kube, args: BindingArgs, annotations: dict[str, str]
) -> bool | None:
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


def _call_binding(
    kube: Kube, args: BindingArgs, annotations: dict[str, str]
) -> KubeError | None:
    """The Binding POST; None when the pod ends up bound as asked."""
    try:
        kube.bind_pod(args.namespace, args.pod_name, args.pod_uid, args.node, annotations)
    except KubeError as exc:
        # 409 "already assigned" is our own earlier attempt when the pod carries our allocation.
        if _bound_as_asked(kube, args, annotations):
            return None
        return exc
    return None


def _claims(binding: PodBinding) -> dict[str, CardClaim]:
    """What a reservation just written takes on each card (from what reserve wrote)."""
    placed = getattr(binding, "placed", None) or ()
    return claims_per_card(
        SliceClaim(uuid, index, init, memory, cores)
        for _, index, init, uuid, _, memory, cores in placed
    )


def _earlier_answer(args: BindingArgs) -> BindAnswer | None:
    """For a pod whose binding this extender already made: the same answer again (no second
    Binding), or a conflict when it holds one on another node. None when the pod has no active
    binding, or only a reservation (whose Binding may still be owed)."""
    existing = ext_selectors.binding_of(args.pod_uid)
    if existing is None or not existing.active:
        return None
    where = existing.node.name if existing.node else ""
    if where != args.node:
        raise BindFailed(
            f"pod {args.namespace}/{args.pod_name} ({args.pod_uid}) is already "
            f"{existing.phase} on node {where or '(none)'}, not {args.node}",
            "conflict",
        )
    if existing.phase != PodBinding.Phase.RESERVED:
        return BindAnswer("already_bound", existing)
    return None


def _read_request(kube: Kube, args: BindingArgs) -> PodRequest | BindAnswer | None:
    """The pod's request read from the API server (a pod filter did not see here); an earlier
    answer for a pod that went after we bound it. Raises BindFailed."""
    try:
        pod = kube.get_pod(args.namespace, args.pod_name)
    except KubeError as exc:
        raise BindFailed(
            f"cannot read the pod from the API server: {exc.message}", "apiserver_error"
        ) from None
    meta = (pod or {}).get("metadata") or {}
    if pod is None or meta.get("uid") != args.pod_uid:
        earlier = _earlier_answer(args)  # the pod went after we bound it: the same answer
        if earlier is not None:
            return earlier
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


def run_bind(args: BindingArgs) -> BindAnswer:
    """Bind the pod (idempotent per pod UID). Raises BindFailed with the reason.

    The common case costs one ledger transaction and the Binding (the confirmation is batched
    off this path, `decisions.record_bound`): the pod's request comes from its filter
    (`RecentRequests`); a pod filter did not see is read from the API server. A repeated bind
    is recognised inside the reservation (or, for a pod that is gone, when it is read).
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
        binding = services.reserve_binding(request, args.node)
    except services.AlreadyPlaced as exc:
        raise BindFailed(exc.message, "conflict") from None
    except services.ServiceError as exc:
        record_bind_outcome(
            args.pod_uid, args.namespace, args.pod_name, Outcome.BIND_FAILED, exc.message
        )
        raise BindFailed(exc.message, "refused") from None
    if getattr(binding, "placed", None) is None and binding.phase != PodBinding.Phase.RESERVED:
        return BindAnswer("already_bound", binding)  # bound before: no second Binding
    snapshot_cache.assume(args.node, _claims(binding), args.pod_uid)

    record = ext_selectors.allocation_of(binding)
    annotations = signing.annotations(record)
    # The crash window: the reservation is committed, the Binding not yet sent. A process dying
    # here leaves a reservation with a deadline; the reconciler finds it (expired_reservations).
    error = _call_binding(kube, args, annotations)
    if error is not None:
        settled = error.applied is False or _bound_as_asked(kube, args, annotations) is False
        if settled:
            services.release_binding(args.pod_uid, f"Binding failed: {error.message}", failed=True)
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
        raise BindFailed(message, "apiserver_error")

    # Confirmed (reserved -> bound) by the decision writer's next batch, many pods in one
    # statement, and not on this path; "why" reads the binding itself, so the filter's held
    # decision is dropped unwritten.
    record_bound(args.pod_uid, timezone.now())
    return BindAnswer("bound", binding)
