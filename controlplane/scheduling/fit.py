"""The filter and bind's entry points: does a pod fit a node, which nodes, which cards.

There is exactly one placement algorithm (placement.py, documented in docs/scheduling.md).
:func:`place_on_node` runs it; :func:`fit_node` and :func:`filter_nodes` answer "would it
succeed?" through the cheapest exact test for the pod's shape (fastcheck.py) and defer the
sentences of infeasible nodes to :func:`~controlplane.scheduling.explain.explain`, worked out
when someone reads ``NodeFit.refusals``.
"""

from __future__ import annotations

from collections.abc import Iterable

from controlplane.scheduling.explain import explain
from controlplane.scheduling.fastcheck import fitter, node_ranking
from controlplane.scheduling.placement import (
    Failure,
    MigFailure,
    allowed_cards,
    assignments,
    greedy,
    mig_assignments,
    mig_greedy,
)
from controlplane.scheduling.request import PodRequest
from controlplane.scheduling.result import Assignment, NodeFit, ReasonCode, Refusal
from controlplane.scheduling.state import MIG, SHARED, NodeState, Snapshot


def fit_node(node: NodeState, request: PodRequest) -> NodeFit:
    """Whether ``request`` fits ``node``; True exactly when :func:`place_on_node` succeeds."""
    if fitter(request.plan)(node.view):
        return NodeFit(node.name, True)
    return NodeFit.deferred(explain, node, request)


def place_on_node(node: NodeState, request: PodRequest) -> tuple[Assignment, ...] | NodeFit:
    """Choose a card for every slice by ``request.gpu_policy``, or say why it cannot.

    Assignments come in container order (init containers first), each container's slices
    best card first. The pod's lanes are tried in order; the first that takes it wins.
    """
    plan = request.plan
    if plan.shared_only:  # nearly every pod: the node's view is its shared cards
        view = node.view
        if view.ok:
            outcome = greedy(view, plan, allowed_cards(view, plan))
            if not isinstance(outcome, Failure):
                return assignments(view, plan, outcome, SHARED)
        return NodeFit(node.name, False, explain(node, request))
    for mode in plan.lanes:
        lane = node.view.lane(mode)
        if lane is None or not lane.ok:
            continue
        if mode == MIG:
            placed = mig_greedy(lane, plan, allowed_cards(lane, plan))
            if not isinstance(placed, MigFailure):
                return mig_assignments(lane, plan, placed)
            continue
        outcome = greedy(lane, plan, allowed_cards(lane, plan))
        if not isinstance(outcome, Failure):
            return assignments(lane, plan, outcome, mode)
    return NodeFit(node.name, False, explain(node, request))


def filter_nodes(
    snapshot: Snapshot, request: PodRequest, names: Iterable[str] | None = None
) -> tuple[list[str], list[NodeFit]]:
    """Split ``names`` (default: every node) into feasible names and infeasible NodeFits.

    Both keep the input order; names the snapshot does not know get an UNKNOWN_NODE refusal.
    """
    ranking = node_ranking(request.plan)
    if ranking is not None:
        key, number, least = ranking
        good = snapshot.ranked(key, number).at_least(least)
        names = [n.name for n in snapshot.nodes] if names is None else list(names)
        feasible = [name for name in names if name in good]
        if len(feasible) == len(names):
            return feasible, []
        return feasible, _failed(snapshot, request, (n for n in names if n not in good))
    fits = fitter(request.plan)
    by_name = snapshot.by_name
    feasible = []
    rest: list[str] = []
    for name in (n.name for n in snapshot.nodes) if names is None else names:
        node = by_name.get(name)
        if node is not None and fits(node.view):
            feasible.append(name)
        else:
            rest.append(name)
    return feasible, _failed(snapshot, request, rest) if rest else []


def _failed(snapshot: Snapshot, request: PodRequest, names: Iterable[str]) -> list[NodeFit]:
    """Infeasible NodeFits of ``names``: deferred explanations, UNKNOWN_NODE for names the
    snapshot does not know.

    The fits are memoised on the snapshot by the pod's shape: kube-scheduler asks
    again about a pod it could not place (after a back-off, and on every cluster event), and
    explaining every card of every node that refused it is the costliest thing the filter
    does, tens of microseconds a node.
    """
    deferred = NodeFit.deferred
    # One deferred fit per node and shape, shared by every pod of the shape: the sentences, and
    # the summary made of them, are worked out once, and a retry builds no new objects.
    fits = snapshot.per_node(
        ("why", request.shape), lambda node: deferred(explain, node, request), None
    )
    by_name = snapshot.by_name
    failed: list[NodeFit] = []
    for name in names:
        node = by_name.get(name)
        if node is None:
            failed.append(
                NodeFit(
                    name,
                    False,
                    (
                        Refusal(
                            ReasonCode.UNKNOWN_NODE,
                            f"node {name} is not in Tessera's inventory "
                            "(no Tessera node plugin has reported it)",
                            None,
                            True,
                        ),
                    ),
                )
            )
        else:
            failed.append(fits[name])
    return failed
