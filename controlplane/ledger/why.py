"""Where a pod stands, and why: the one answer to "why is my pod pending?".

The REST API (`/api/v1/pods/<ns>/<name>/why`) and the dashboard's pod page both read it here, so
they never disagree on which fact wins. The facts are the pod's latest binding (any phase) and
its latest scheduling decision (the filter's outcome, or bind's refusal). When they belong to
different pods of that name (a pod deleted and created again), the newer one is the answer and
the other is dropped. Then, in order:

1. a binding that is bound or allocated: not pending;
2. a reservation: waiting for the API server to accept the Binding;
3. a decision that found no room, an invalid request, or a failed bind: pending, with its reasons;
4. a failed binding: pending, its bind failed (the scheduler tries again); a released one: not
   pending any more, it holds nothing;
5. a feasible decision: nodes were found, the bind is on its way.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import Q, Sum

from controlplane.ledger.models import PodBinding, SchedulingDecision, Slice

Phase = PodBinding.Phase
Outcome = SchedulingDecision.Outcome
WAITING = (Outcome.UNSCHEDULABLE, Outcome.INVALID, Outcome.BIND_FAILED)


@dataclass(frozen=True, slots=True)
class BindingFacts:
    """A binding as the answer needs it: its phase, node and what it holds while it runs (its
    app and sidecar containers)."""

    pod_uid: str
    phase: str
    node: str | None
    reason: str
    created_at: datetime
    reserved_at: datetime | None
    cards: tuple[str, ...]
    memory_mib: int
    cores: int

    @property
    def since(self) -> datetime:
        return self.reserved_at or self.created_at


@dataclass(frozen=True, slots=True)
class PodStatus:
    """The answer: `outcome` and `summary` for machines, `text` for people."""

    namespace: str
    name: str
    pod_uid: str
    outcome: str
    summary: str
    text: str
    decided_at: datetime
    binding: BindingFacts | None
    decision: SchedulingDecision | None


def pod_status(namespace: str, name: str) -> PodStatus | None:
    """Where the pod called namespace/name stands (three queries); None when Tessera has no
    record of it."""
    binding = binding_facts(namespace, name)
    decision = (
        SchedulingDecision.objects.filter(namespace=namespace, name=name)
        .order_by("-decided_at", "-id")
        .first()
    )
    return explain(namespace, name, binding, decision)


def binding_facts(namespace: str, name: str) -> BindingFacts | None:
    """The latest binding of a pod of that name, with the totals of its slices (two queries)."""
    row = (
        PodBinding.objects.filter(namespace=namespace, name=name)
        .order_by("-created_at", "-id")
        .values_list("id", "pod_uid", "phase", "node__name", "reason", "created_at", "reserved_at")
        .first()
    )
    if row is None:
        return None
    slices = Slice.objects.filter(binding_id=row[0])
    # What the pod holds while it runs: its app containers and its sidecars.
    running = Q(init_container=False) | Q(sidecar=True)
    totals = slices.aggregate(
        memory=Sum("memory_mib", filter=running), cores=Sum("compute_percent", filter=running)
    )
    cards = sorted(set(slices.values_list("card__uuid", flat=True)))
    return BindingFacts(
        *row[1:], tuple(cards), int(totals["memory"] or 0), int(totals["cores"] or 0)
    )


def explain(
    namespace: str,
    name: str,
    binding: BindingFacts | None,
    decision: SchedulingDecision | None,
) -> PodStatus | None:
    """The answer from the pod's latest binding and latest decision (no queries)."""
    if binding is not None and decision is not None and binding.pod_uid != decision.pod_uid:
        if decision.decided_at > binding.since:
            binding = None  # a newer pod of that name is pending: its decision is the answer
        else:
            decision = None  # the decision was an older pod's
    if binding is None and decision is None:
        return None
    before = f" Before that: {decision.summary}" if decision is not None else ""
    if binding is not None and binding.phase in (Phase.BOUND, Phase.ALLOCATED, Phase.RESERVED):
        where = binding.node or "?"
        summary = f"{binding.phase} on node {where}, cards {', '.join(binding.cards)}.{before}"
        if binding.phase == Phase.RESERVED:
            outcome = decision.outcome if decision is not None else Outcome.FEASIBLE
            text = (
                f"Room is reserved on node {where}; Tessera is waiting for the Kubernetes API "
                "server to accept the pod's Binding. If it does not before the reservation's "
                "deadline, the reconciler frees the room and the scheduler tries again."
            )
        else:
            outcome = Outcome.BOUND
            state = "has its GPUs" if binding.phase == Phase.ALLOCATED else "is bound"
            text = (
                f"Not pending: the pod {state} on node {where}, holding {binding.memory_mib} MiB "
                f"and {binding.cores}% compute on {len(binding.cards)} card(s)."
            )
    elif decision is not None and decision.outcome in WAITING:
        outcome, summary = decision.outcome, decision.summary
        text = _waiting_text(decision)
        if decision.preemption:
            summary = f"{summary} Preemption: {decision.preemption}"
            text = f"{text} Preemption: {decision.preemption}"
    elif binding is not None and binding.phase == Phase.FAILED:
        # A failed bind leaves the pod unbound: kube-scheduler puts it back in its queue and
        # tries again, and until its next filter this binding is the only answer there is.
        reason = binding.reason or "the bind did not complete"
        outcome, summary = Outcome.BIND_FAILED, f"failed: {reason}.{before}"
        text = (
            f"Pending: the last bind failed ({reason}); it holds no GPU, and the scheduler "
            "tries again."
        )
    elif binding is not None:
        reason = f" ({binding.reason})" if binding.reason else ""
        outcome = binding.phase
        summary = f"{binding.phase}{': ' + binding.reason if binding.reason else ''}.{before}"
        text = f"Not pending: the pod ended{reason}; it holds no GPU now."
    else:
        assert decision is not None
        outcome, summary = decision.outcome, decision.summary
        text = f"Feasible nodes were found ({decision.summary.strip()}); waiting for the bind."
    return PodStatus(
        namespace=namespace,
        name=name,
        pod_uid=decision.pod_uid if decision is not None else binding.pod_uid,  # type: ignore[union-attr]
        outcome=str(outcome),
        summary=summary,
        text=text,
        decided_at=decision.decided_at if decision is not None else binding.since,  # type: ignore[union-attr]
        binding=binding,
        decision=decision,
    )


def _waiting_text(decision: SchedulingDecision) -> str:
    text = decision.summary.strip() or "The scheduler found no node with room."
    if decision.outcome == Outcome.UNSCHEDULABLE:
        counts = sorted(decision.reason_counts.items(), key=lambda kv: (-kv[1], kv[0]))
        if counts:
            parts = ", ".join(f"{n} node(s): {code.replace('_', ' ')}" for code, n in counts)
            text += f" Of {decision.nodes_considered} node(s) considered: {parts}."
        return "Pending: " + text
    if decision.outcome == Outcome.INVALID:
        return "Never schedulable as written: " + text + " Fix the pod's GPU request."
    return "Pending: the last bind failed. " + text
