"""The filter's cheaper equivalents of "the greedy would place the pod on this node".

:func:`fitter` picks, once per pod, the cheapest exact node test for its shape;
:func:`node_ranking` turns the commonest shape (one slice on shared cards, no card filters)
into one number per node that a :meth:`~controlplane.scheduling.state.Snapshot.ranked` index
answers with a binary search. Each test is proved equivalent (or one-sided, and then backed
by the greedy itself) in its docstring, and the property tests check them against a plain
reference model on random clusters. They read the flat tuples of
:class:`~controlplane.scheduling.state.NodeView` and build no objects for feasible nodes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Hashable
from functools import partial

from controlplane.scheduling.claims import EXCLUSIVE_CORES
from controlplane.scheduling.memory import MIB, PERCENT, WHOLE, sizer
from controlplane.scheduling.placement import (
    Failure,
    MigFailure,
    allowed_cards,
    greedy,
    mig_greedy,
)
from controlplane.scheduling.request import ContainerPlan, Plan
from controlplane.scheduling.state import KEY_BITS, KEY_MASK, MIG, SHARED, NodeState, NodeView

# A packed key below any card's: a card whose last slot is gone.
_GONE = -(1 << 62)

# A node test: True iff the greedy placement of the (closed-over) plan would succeed.
_Fitter = Callable[[NodeView], bool]


def _fits_mig(view: NodeView, plan: Plan) -> bool:
    """Whether the MIG lane of the node takes the pod (the MIG greedy itself: MIG nodes are
    few, and a card's placements do not reduce to one number)."""
    lane = view.lane(MIG)
    if lane is None or not lane.ok:
        return False
    return not isinstance(mig_greedy(lane, plan, allowed_cards(lane, plan)), MigFailure)


def _count(view: NodeView, cp: ContainerPlan, allowed: tuple[bool, ...] | None, enough: int) -> int:
    """Cards that could take one slice of ``cp`` on the node as it is (stops at ``enough``).

    Same test as the greedy's, on the initial state: ``fmem`` already folds "exclusive
    tenant", "no free slot" and "no compute left" into -1 MiB, which no need (>= 0) fits in.
    """
    size, cores, strict = cp.need, cp.cores, cp.strict
    fmem, fcu, tmem, busy = view.fmem, view.fcu, view.tmem, view.busy
    found = 0
    for p in range(view.n):
        if allowed is not None and not allowed[p]:
            continue
        need = size(tmem[p])
        if fmem[p] >= need and fcu[p] >= cores and not (strict and busy[p]):
            found += 1
            if found >= enough:
                break
    return found


def _count_abs(view: NodeView, need: int, cores: int, enough: int) -> int:
    """``_count`` for absolute memory, a non-exclusive slice and no card filters.

    Walks live cards from the most free memory down and stops at the first one too small.
    """
    found = 0
    for fm, fc in zip(view.d_fmem, view.d_fcu, strict=True):
        if fm < need:
            break
        if fc >= cores:
            found += 1
            if found >= enough:
                break
    return found


def _count_stack(view: NodeView, plan: Plan, allowed: tuple[bool, ...] | None, enough: int) -> int:
    """Cards that could hold one slice of EVERY app container at the same time.

    Only meaningful when no app container is strict (the caller checks). ``Stack.cores``
    keeps 1% over for an app container that asks 0% after the others took theirs (a card with
    no compute left refuses even that).
    """
    n_app = len(plan.apps)
    stack = plan.stack
    base, wholes, cores = stack.mib, stack.wholes, stack.cores
    shares = tuple(sizer(PERCENT, pct) for pct in stack.percents)
    whole = sizer(WHOLE, 100)
    raw, fcu, fslots, excl, tmem = view.raw_fmem, view.fcu, view.fslots, view.excl, view.tmem
    found = 0
    for p in range(view.n):
        if allowed is not None and not allowed[p]:
            continue
        if excl[p] or fslots[p] < n_app or fcu[p] < cores:
            continue
        total = tmem[p]
        need = base + wholes * whole(total)
        for share in shares:
            need += share(total)
        if raw[p] >= need:
            found += 1
            if found >= enough:
                break
    return found


def _multi_abs_fitter(plan: Plan) -> _Fitter:
    """ "The greedy succeeds" for plans with ``abs_apps``: absolute memory, no exclusive app
    container, no card filters (see :func:`_fits_general` for the general case).

    1. O(1) refusals, each a necessary condition of any placement: every app slice lands on
       a live card (free slot, no exclusive tenant), within its free memory and compute and
       in one of its free slots; so the largest ask must fit the best card and the totals
       must fit the node's totals.
    2. The stack acceptance of ``_fits_general`` step 3, walking live cards from the most
       free memory down (it stops at the first card too small).
    3. Otherwise the greedy itself, on packed keys: a card can take a slice iff it is live,
       has the memory and has the compute, and the greedy's order (free after placement,
       position) is the order of the keys ``free << KEY_BITS | position`` (for spread the
       position is flipped and the list read from the top). Each container takes the first
       ``gpus`` keys in that order that pass the compute test, exactly the head of the
       greedy's sorted candidate list; those cards lose the memory, the compute and a slot,
       and a card whose last slot or last compute goes gets a key below every need. Init
       containers are counted separately; they leave no trace on the app containers' room.

    The plan's numbers are bound once into a closure: this runs for every node of the
    cluster.
    """
    shape = plan.abs_apps
    assert shape is not None
    apps = shape.asks
    max_mem, total_mem, slices = shape.max_mib, shape.total_mib, shape.slices
    max_cores, total_cores = shape.max_cores, shape.compute
    inits = plan.inits
    stack_mem, stack_cores, n_app = plan.stack.mib, plan.stack.cores, len(plan.apps)
    enough = plan.stack.cards
    binpack = plan.policy.gpu_binpack

    def fits(view: NodeView) -> bool:
        if (
            not view.ok
            or max_mem > view.max_fmem
            or total_mem > view.live_free
            or slices > view.live_slots
            or max_cores > view.max_fcu
            or total_cores > view.live_compute
        ):
            return False
        for cp in inits:
            if _count(view, cp, None, cp.gpus) < cp.gpus:
                return False
        if stack_cores <= view.max_fcu:
            found = 0
            for fm, fc, fs in zip(view.d_fmem, view.d_fcu, view.d_fslots, strict=True):
                if fm < stack_mem:
                    break
                if fc >= stack_cores and fs >= n_app:
                    found += 1
                    if found >= enough:
                        return True
        keys = view.keys_binpack if binpack else view.keys_spread
        if keys is None:
            return not isinstance(greedy(view, plan, None), Failure)
        fc_ = list(view.fcu)
        # A card takes at most one slice per app container: with that many free slots on
        # every live card, slots cannot run out and need no tracking.
        fs_ = list(view.fslots) if view.min_live_slots < n_app else None
        work = list(keys)
        # A picked card's key is rewritten in place as soon as it is picked: the scan never
        # returns to an index it passed, and the list is re-sorted once per container. Binpack
        # and spread scan in two loops of the same body: one loop over a range in either
        # direction cost 15 % more on the 4 x 2 GPUs filter (bench_core, 1,000 nodes).
        for need, cores, gpus in apps:
            floor = need << KEY_BITS  # keys >= floor: exactly the cards with free >= need
            last = len(work)
            left = gpus
            if binpack:
                j = bisect_left(work, floor)
                if last - j < gpus:
                    return False
                while j < last:
                    key = work[j]
                    p = key & KEY_MASK
                    # Live cards have compute left (or none to book: 0 units), so a 0% ask
                    # passes; a pick that books the last of it retires the card.
                    if fc_[p] >= cores:
                        fc_[p] -= cores
                        if fs_ is None:
                            work[j] = _GONE if cores and not fc_[p] else key - floor
                        else:
                            fs_[p] -= 1
                            work[j] = key - floor if fs_[p] and (fc_[p] or not cores) else _GONE
                        left -= 1
                        if not left:
                            break
                    j += 1
                else:
                    return False
            else:
                j = last - 1
                while j >= 0:
                    key = work[j]
                    if key < floor:
                        return False
                    p = KEY_MASK - (key & KEY_MASK)
                    if fc_[p] >= cores:
                        fc_[p] -= cores
                        if fs_ is None:
                            work[j] = _GONE if cores and not fc_[p] else key - floor
                        else:
                            fs_[p] -= 1
                            work[j] = key - floor if fs_[p] and (fc_[p] or not cores) else _GONE
                        left -= 1
                        if not left:
                            break
                    j -= 1
                else:
                    return False
            work.sort()
        return True

    return fits


def _fits_general(view: NodeView, plan: Plan) -> bool:
    """Exactly "the greedy succeeds", answered as cheaply as the case allows.

    1. Init containers fit independently of everything else, and a container's slices are
       identical, so each init container succeeds iff at least ``gpus`` cards can take one
       slice: a count, exact.
    2. One app container: the same count, exact.
    3. Several app containers, none strict: if at least max(gpus) cards can each hold one
       slice of every app container at once, the greedy succeeds. Proof: at container k's
       turn such a card has received at most one slice of each earlier container, so what
       is left still covers container k; container k needs ``gpus_k`` distinct feasible
       cards and there are at least that many such cards. (Sufficient only.)
    4. Placing slices only ever removes room, so a container that fails the count on the
       untouched node fails in the greedy too. (Necessary only.)
    5. Otherwise run the greedy itself.

    Steps 1-4 hold for any order of cards (``numa``) and for strict slices (``mutex``: the
    count skips busy cards, and no stack is strict-free). Sidecars (init containers that take
    room from later ones) and numa-bind (a count of cards is not a count per NUMA node) go
    straight to the greedy.
    """
    if not view.ok:
        return False
    allowed = allowed_cards(view, plan)
    # A spilling slice's room is not the counts' free memory (see _spilling_fitter).
    if plan.greedy_only or (plan.oversub and view.oversub):
        return not isinstance(greedy(view, plan, allowed), Failure)
    for cp in plan.inits:
        if _count(view, cp, allowed, cp.gpus) < cp.gpus:
            return False
    apps = plan.apps
    if len(apps) == 1 and allowed is None and apps[0].kind == MIB and not apps[0].strict:
        only = apps[0]
        return _count_abs(view, only.value, only.cores, only.gpus) >= only.gpus
    if not apps:
        return True
    if len(apps) == 1:
        return _count(view, apps[0], allowed, apps[0].gpus) >= apps[0].gpus
    if not plan.stack.exclusive:
        enough = plan.stack.cards
        if _count_stack(view, plan, allowed, enough) >= enough:
            return True
    for cp in apps:
        if _count(view, cp, allowed, cp.gpus) < cp.gpus:
            return False
    return not isinstance(greedy(view, plan, allowed), Failure)


def fitter(plan: Plan) -> _Fitter:
    """The cheapest exact node test for ``plan``.

    A pod that uses shared cards only (nearly all) is tested on the node's view, which holds
    exactly its shared cards. Otherwise each of the plan's lanes is tried in order on the
    node's cards of that mode: MPS and exclusive cards by the shared test, MIG cards by the
    MIG greedy.
    """
    shared = _shared_fitter(plan)
    if plan.shared_only:
        return shared
    tests: list[_Fitter] = []
    for mode in plan.lanes:
        if mode == MIG:
            tests.append(partial(_fits_mig, plan=plan))
        elif mode == SHARED:
            tests.append(shared)
        else:
            tests.append(partial(_fits_lane, mode, shared))

    def any_lane(view: NodeView) -> bool:
        return any(test(view) for test in tests)

    return any_lane


def _fits_lane(mode: str, test: _Fitter, view: NodeView) -> bool:
    lane = view.lane(mode)
    return lane is not None and test(lane)


def _shared_fitter(plan: Plan) -> _Fitter:
    """The exact test of the shared greedy on one lane's view.

    With include/exclude annotations, a node where the pod may use every schedulable card
    is tested as if there were none, a node where it may use none fails, and only the
    rest take the general path with a per-card mask.
    """
    base = _shape_fitter(plan)
    if plan.oversub:
        base = _spilling_fitter(plan, base)
    if not plan.cards is not None:
        return base

    def filtered(view: NodeView) -> bool:
        mask = allowed_cards(view, plan)
        assert mask is not None
        if all(mask):
            return base(view)
        if not any(mask):
            return False
        return _fits_general(view, plan)

    return filtered


def _spilling_fitter(plan: Plan, base: _Fitter) -> _Fitter:
    """The test for a pod that opted in to virtual device memory.

    On a node none of whose cards has a factor above 1 an opted-in slice is resident in full,
    exactly a slice without the opt-in, so the shape's own test answers. Elsewhere the counts
    and rankings above cannot see the three budgets (a slice's resident part and spill depend
    on the card, and the spill on every card the pod takes on the node): the greedy itself
    decides, with them. These nodes are few, and so are the pods that opt in.
    """

    def fits(view: NodeView) -> bool:
        if not view.oversub:
            return base(view)
        if not view.ok:
            return False
        return not isinstance(greedy(view, plan, allowed_cards(view, plan)), Failure)

    return fits


def _shape_fitter(plan: Plan) -> _Fitter:
    """The cheapest exact node test for ``plan``'s shape, card filters left out.

    For one container with one slice the greedy succeeds iff some card passes the slice
    test, so the test is an ``any`` over cards; with absolute memory and no compute ask it
    is "need <= the node's best free memory", O(1).
    """
    if plan.abs_apps is not None:
        return _multi_abs_fitter(plan)
    cp = plan.single
    if cp is None:
        return partial(_fits_general, plan=plan)
    cores = cp.cores
    if cp.kind == MIB and cores < EXCLUSIVE_CORES:
        need = cp.value
        if cores == 0:
            return lambda view: view.ok and need <= view.max_fmem

        def single_abs(view: NodeView) -> bool:
            if need > view.max_fmem or not view.ok:
                return False
            # A plain loop, not any(<generator>): this runs per node per cycle and the
            # generator costs about twice as much. Most free memory first, so it stops at
            # the first card too small.
            for fm, fc in zip(view.d_fmem, view.d_fcu, strict=True):
                if fm < need:
                    return False
                if fc >= cores:
                    return True
            return False

        return single_abs

    def single_any(view: NodeView) -> bool:
        return view.ok and _count(view, cp, None, 1) >= 1

    return single_any


def node_ranking(
    plan: Plan,
) -> tuple[Hashable, Callable[[NodeState], int | None], int] | None:
    """For the common shape, one container with one slice on shared cards and no card
    filters: (key, number, least) such that a node fits iff ``number(node) >= least``, the
    node test as a Snapshot ranking. None for any other shape.

    Absolute memory: the most free MiB of a card that also has the compute, against the ask
    (one ranking per compute ask serves every memory ask). A share of the card's memory: the
    most MiB a card with the compute would have left after the slice, against 0.
    """
    cp = plan.single
    if (
        plan.cards is not None
        or plan.oversub  # the budgets of a spilling slice are not one number per node
        or cp is None
        or not plan.shared_only
        or cp.strict
        or cp.kind == WHOLE
    ):
        return None
    if cp.kind == MIB:
        return ("room", cp.cores), partial(_room, cp.cores), cp.value
    return ("left", cp.value, cp.cores), partial(_left, cp.value, cp.cores), 0


def _room(cores: int, node: NodeState) -> int | None:
    view = node.view
    if not view.ok:
        return None
    # Live cards, most free memory first: the first with the compute has the most room.
    for fm, fc in zip(view.d_fmem, view.d_fcu, strict=True):
        if fc >= cores:
            return fm
    return None


def _left(percent: int, cores: int, node: NodeState) -> int | None:
    view = node.view
    if not view.ok:
        return None
    share = sizer(PERCENT, percent)
    best = None
    for fm, fc, tm in zip(view.fmem, view.fcu, view.tmem, strict=True):
        if fm >= 0 and fc >= cores:
            left = fm - share(tm)
            if best is None or left > best:
                best = left
    return best
