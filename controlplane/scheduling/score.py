"""Node scores: how full a node's cards are once the pod is on them (docs/scheduling.md,
section 6), for kube-scheduler's prioritize call."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from controlplane.scheduling.memory import MIB
from controlplane.scheduling.request import Plan, PodRequest
from controlplane.scheduling.state import NodeState, NodeView, Snapshot


def _demand(plan: Plan, card_mib: int) -> int:
    """The pod's memory on a node whose cards average ``card_mib``, at its peak (Plan.peak:
    the app containers with the sidecars, or an init container with the sidecars before it)."""
    return plan.peak(lambda cp: cp.gpus * cp.need(card_mib))


def _fixed_demand(plan: Plan) -> int | None:
    """The pod's demand when it does not depend on card size (all absolute MiB)."""
    if all(cp.kind == MIB for cp in plan.containers):
        return _demand(plan, 0)
    return None


def _score_view(view: NodeView, plan: Plan) -> NodeView:
    """The cards a score counts: the first of the pod's lanes the node has cards in."""
    for mode in plan.lanes:
        lane = view.lane(mode)
        if lane is not None and lane.n:
            return lane
    return view


def _scores(
    names: Iterable[str], nodes: Mapping[str, NodeState], plan: Plan, fixed: int | None
) -> list[tuple[str, int]]:
    """``(name, score)`` for each name, 0 for a name not in ``nodes``: the one scoring rule.

    One loop for every caller rather than a function called per node: prioritize runs it for
    every feasible node of every cycle, and a call per node cost 13 % more at 1,000 nodes.
    """
    binpack = plan.policy.node_binpack
    lanes = not plan.shared_only
    # Percent and whole-card asks depend on the node's card size; sizes repeat a lot.
    per_size: dict[int, int] = {}
    out: list[tuple[str, int]] = []
    for name in names:
        node = nodes.get(name)
        if node is None:
            out.append((name, 0))
            continue
        view = _score_view(node.view, plan) if lanes else node.view
        total = view.mem_total
        if total <= 0:
            out.append((name, 0))
            continue
        demand = fixed
        if demand is None:
            demand = per_size.get(view.avg_mem)
            if demand is None:
                demand = per_size[view.avg_mem] = _demand(plan, view.avg_mem)
        # round(10 * used / total), halves up, in integers; clamped for over-committed nodes.
        packed = (20 * (view.mem_used + demand) + total) // (2 * total)
        packed = 0 if packed < 0 else 10 if packed > 10 else packed
        out.append((name, packed if binpack else 10 - packed))
    return out


def score_node(node: NodeState, request: PodRequest) -> int:
    """0..10 by ``request.node_policy`` (binpack: fuller after placement scores higher)."""
    plan = request.plan
    return _scores((node.name,), {node.name: node}, plan, _fixed_demand(plan))[0][1]


def prioritize(
    snapshot: Snapshot, request: PodRequest, names: Iterable[str]
) -> list[tuple[str, int]]:
    """``(name, score)`` for each name in order; unknown names score 0."""
    plan = request.plan
    fixed = _fixed_demand(plan)
    if fixed is None or not plan.shared_only:
        return _scores(names, snapshot.by_name, plan, fixed)
    # The score depends on the node and on these two only: memoised.
    key = ("score", fixed, plan.policy.node_binpack)
    scores = snapshot.remembered(key)
    if scores is not None:
        return [(name, scores[name]) for name in names]
    out = _scores(names, snapshot.by_name, plan, fixed)
    # Worked out here, in one loop, rather than node by node through the memo: a new shape
    # scores every feasible node at once, and the loop costs a third as much.
    snapshot.per_node(key, lambda node: score_node(node, request), 0).update(out)
    return out
