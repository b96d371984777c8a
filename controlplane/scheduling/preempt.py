"""Which pods to evict so that a higher-priority pod fits on a node (docs/preemption.md).

kube-scheduler cannot preempt for GPU slices (they are ignored by its own filters), so Tessera
chooses victims itself, from the ledger: on one node, among the pods of lower priority, the
set whose slices make the preemptor fit, preferring

1. the fewest pods,
2. then the lowest priorities (the set whose highest priority is lowest, then the next, ...),
3. then the most recently started (the least work lost; Kubernetes' own tie-break),

and never more pods of one PodDisruptionBudget than the budget allows now. The search is
exact: sets of one pod, then of two, ..., each size in full. A node with many candidates could
make that slow, so past ``max_checks`` fit tests it falls back to Kubernetes' own way (evict
every candidate the budgets allow, then keep back, highest priority first, every pod the
preemptor still fits without): a set no pod of which can be spared, maybe not the smallest.

The pure rule only; the rest of preemption (the extender's verb and its own preemptor, the
ledger's reads and holds) is mapped in ``controlplane.extender.preemption``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations

from controlplane.scheduling.claims import CardClaim
from controlplane.scheduling.fit import fit_node
from controlplane.scheduling.request import PodRequest
from controlplane.scheduling.state import NodeState

MAX_CHECKS = 2000  # fit tests of the exact search per node before the fallback


@dataclass(frozen=True, slots=True)
class Candidate:
    """A pod on the node that holds slices, as preemption sees it."""

    uid: str
    namespace: str
    name: str
    priority: int
    started: float  # seconds since the epoch: when it was bound (later = less work lost)
    claims: Mapping[str, CardClaim]  # card UUID -> what it holds there
    # The PodDisruptionBudget that covers it ("namespace/name"), if any.
    budget: str | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Victims:
    """The pods to evict on ``node`` (empty: the preemptor fits as things are)."""

    node: str
    pods: tuple[Candidate, ...]
    exact: bool = True  # False: the fallback chose them (no smaller set was searched for)

    @property
    def rank(self) -> tuple[int, tuple[int, ...], tuple[float, ...]]:
        return rank(self.pods)


@dataclass(frozen=True, slots=True)
class NoVictims:
    """Why no set of victims makes the preemptor fit on ``node``."""

    node: str
    reason: str
    blocked_by_budget: tuple[str, ...] = field(default=())  # budgets that stood in the way


def rank(pods: Iterable[Candidate]) -> tuple[int, tuple[int, ...], tuple[float, ...]]:
    """The order of preference among victim sets: smaller is better (see the module doc)."""
    pods = tuple(pods)
    return (
        len(pods),
        tuple(sorted((p.priority for p in pods), reverse=True)),
        tuple(sorted(-p.started for p in pods)),
    )


def _within_budgets(pods: Sequence[Candidate], allowed: Mapping[str, int]) -> bool:
    counts: dict[str, int] = {}
    for p in pods:
        if p.budget is not None:
            counts[p.budget] = counts.get(p.budget, 0) + 1
            if counts[p.budget] > allowed.get(p.budget, 0):
                return False
    return True


def _exclusive_left(gone: Sequence[Candidate], all_pods: Sequence[Candidate]) -> frozenset[str]:
    """Cards on which a pod that stays holds a 100%-compute slice."""
    leaving = {p.uid for p in gone}
    return frozenset(
        uuid
        for p in all_pods
        if p.uid not in leaving
        for uuid, claim in p.claims.items()
        if claim.exclusive
    )


def _fits_without(
    node: NodeState,
    request: PodRequest,
    gone: Sequence[Candidate],
    all_pods: Sequence[Candidate],
) -> bool:
    freed = node.without_claims([p.claims for p in gone], _exclusive_left(gone, all_pods))
    return fit_node(freed, request).feasible


def choose_victims(
    node: NodeState,
    request: PodRequest,
    pods: Sequence[Candidate],
    *,
    priority: int,
    budgets: Mapping[str, int] | None = None,
    max_checks: int = MAX_CHECKS,
) -> Victims | NoVictims:
    """The best set of victims on ``node`` for ``request`` at ``priority``, or why there is none.

    ``pods`` are every pod holding slices on the node (all of them: the ones that stay still
    hold their room); only those of lower priority than ``priority`` may be chosen.
    ``budgets``: PodDisruptionBudget name -> disruptions it allows now (a budget a candidate
    names and this map lacks allows none).
    """
    allowed = budgets or {}
    if fit_node(node, request).feasible:
        return Victims(node.name, ())
    lower = [p for p in pods if p.priority < priority]
    if not lower:
        return NoVictims(node.name, "no pod of lower priority holds slices there")
    if not _fits_without(node, request, lower, pods):
        return NoVictims(node.name, "even with every lower-priority pod gone it would not fit")
    free = [p for p in lower if p.budget is None or allowed.get(p.budget, 0) > 0]
    if not free or not _fits_without(node, request, free, pods):
        stuck = sorted({p.budget for p in lower if p.budget is not None})
        return NoVictims(
            node.name,
            "it would fit only by evicting pods their PodDisruptionBudget protects ("
            + ", ".join(stuck)
            + ")",
            tuple(stuck),
        )
    # Preferred candidates first, so that within one size the first fitting set found is
    # usually the best and ranks settle ties the same way every time.
    free.sort(key=lambda p: (p.priority, -p.started, p.uid))
    checks = 0
    for size in range(1, len(free) + 1):
        best: tuple[Candidate, ...] | None = None
        for chosen in combinations(free, size):
            if not _within_budgets(chosen, allowed):
                continue
            if best is not None and rank(chosen) >= rank(best):
                continue
            checks += 1
            if checks > max_checks:
                return _reprieve(node, request, free, pods, allowed)
            if _fits_without(node, request, chosen, pods):
                best = chosen
        if best is not None:
            return Victims(node.name, best)
    # Unreachable: the full set of free candidates fits (checked above).
    return _reprieve(node, request, free, pods, allowed)


def _reprieve(
    node: NodeState,
    request: PodRequest,
    free: Sequence[Candidate],
    pods: Sequence[Candidate],
    allowed: Mapping[str, int],
) -> Victims | NoVictims:
    """Kubernetes' way: take every candidate, then give back, highest priority and oldest
    first, each pod without which the preemptor still fits; budgets are honoured by giving back
    first the pods of budgets that are over."""
    chosen = list(free)
    for p in sorted(free, key=lambda p: (-p.priority, p.started, p.uid)):
        trial = [q for q in chosen if q.uid != p.uid]
        if _fits_without(node, request, trial, pods):
            chosen = trial
    if not _within_budgets(chosen, allowed):
        return NoVictims(node.name, "no set of victims within the PodDisruptionBudgets was found")
    return Victims(node.name, tuple(chosen), exact=False)
