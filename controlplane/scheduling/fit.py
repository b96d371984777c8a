"""Fit, placement and scoring of one pod on nodes.

There is exactly one placement algorithm, :func:`_greedy` (documented in
docs/scheduling.md). :func:`place_on_node` runs it; :func:`fit_node` and
:func:`filter_nodes` answer "would it succeed?" and only run it when no cheaper test
settles the question. Each cheaper test is proved equivalent or one-sided below, and the
property tests check the agreement on random clusters.

The filter loops read the flat tuples of :class:`~controlplane.scheduling.state.NodeView`
instead of card objects, build no objects for feasible nodes, and defer the sentences of
infeasible ones to :func:`explain` (called when someone reads ``NodeFit.refusals``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterable, Iterator
from functools import partial

from controlplane.scheduling.claims import EXCLUSIVE_CORES
from controlplane.scheduling.mig import (
    MigGeometry,
    MigProfile,
    choose_start,
    free_slices,
    profile_for,
)
from controlplane.scheduling.request import SHARED_MODE, ContainerPlan, Plan, PodRequest
from controlplane.scheduling.result import Assignment, NodeFit, ReasonCode, Refusal
from controlplane.scheduling.state import (
    EXCLUSIVE,
    KEY_BITS,
    KEY_MASK,
    MIG,
    SHARED,
    CardState,
    NodeState,
    NodeView,
    Snapshot,
)

# A packed key below any card's: a card whose last slot is gone.
_GONE = -(1 << 62)

# A node test: True iff the greedy placement of the (closed-over) plan would succeed.
_Fitter = Callable[[NodeView], bool]

# The working state of the greedy: per schedulable card position, free memory, free
# compute, free slots, busy (holds any slice), exclusive (holds a 100%-compute slice).
_State = tuple[list[int], list[int], list[int], list[bool], list[bool]]


class _Failure:
    """Where the greedy stopped: the container, the cards that still had room, the state.

    ``numa_split`` is True when enough cards had room but no NUMA node had enough of them
    (the pod asked for nvidia.com/numa-bind).
    """

    __slots__ = ("candidates", "container", "labels", "numa_split", "own", "state")

    def __init__(
        self,
        container: ContainerPlan,
        candidates: list[int],
        state: _State,
        own: set[int],
        labels: tuple[str, ...],
        numa_split: bool = False,
    ) -> None:
        self.container = container
        self.labels = labels
        self.candidates = candidates
        self.state = state
        self.own = own  # positions holding an earlier slice of this same pod
        self.numa_split = numa_split


# ------------------------------------------------------------------ the one algorithm


def _allowed(view: NodeView, plan: Plan) -> tuple[bool, ...] | None:
    """Per card position, whether the include/exclude annotations let the pod use it.

    None when the pod has no such annotation. The type part depends only on the node's
    list of models, which repeats across a cluster, so it is memoised per plan; the uuid
    part is skipped with one C-level set test on nodes the uuid lists do not mention.
    """
    if not plan.filtered:
        return None
    key = view.models_key
    mask = plan.mask_memo.get(key)
    if mask is None:
        mask = plan.mask_memo[key] = tuple(plan.type_allowed(m) for m in view.model_l)
    use, nouse = plan.use_uuids, plan.nouse_uuids
    if use or nouse:
        uuids = view.uuid_l
        if use and use.isdisjoint(uuids):
            return (False,) * view.n
        if not use and nouse.isdisjoint(uuids):
            return mask
        mask = tuple(
            ok and (not use or u in use) and u not in nouse
            for ok, u in zip(mask, uuids, strict=True)
        )
    return mask


def _greedy(
    view: NodeView, plan: Plan, allowed: tuple[bool, ...] | None
) -> list[list[int]] | _Failure:
    """Choose card positions for every slice of every container, or say where it fails.

    Containers are placed in order on one working state. An ordinary init container reads it
    and leaves no trace (init containers run one at a time, before the app containers; see
    claims.py), so it sees the node as it is plus the sidecars started before it. A sidecar
    and each app container take room that every later container sees. A container's slices
    go on distinct cards; because they are identical, placing them one by one with the
    policy's choice equals taking the best ``gpus`` feasible cards by (free memory after
    placement, index): ascending for binpack, descending free memory for spread, with the
    card's NUMA node before or after the room where the policy names ``numa``. With
    numa-bind they are the best ``gpus`` of the first NUMA node to offer that many.
    """
    work: _State = (
        list(view.raw_fmem),
        list(view.fcu),
        list(view.fslots),
        list(view.busy),
        list(view.excl),
    )
    fm, fc, fs, busy, ex = work
    own: set[int] = set()
    tmem, tcu = view.tmem, view.tcu
    binpack = plan.gpu_binpack
    order = plan.numa_order
    numa = view.numa if order or plan.numa_bind else ()
    chosen: list[list[int]] = []
    for cp in plan.containers:
        cores = cp.cores
        strict = cp.strict
        cand: list[tuple[int, ...]] = []
        for p in range(view.n):
            if allowed is not None and not allowed[p]:
                continue
            need = cp.need(tmem[p])
            if (
                ex[p]
                or fs[p] <= 0
                or need > fm[p]
                or cores > fc[p]
                or (not fc[p] and tcu[p])  # compute fully booked: not even a 0% slice
                or (strict and busy[p])
            ):
                continue
            room = fm[p] - need if binpack else need - fm[p]
            if not order:
                cand.append((room, p))
            elif order == 1:
                cand.append((numa[p], room, p))
            else:
                cand.append((room, numa[p], p))
        picks = _best(cand, cp.gpus, plan.numa_bind, numa)
        if not isinstance(picks, list):
            return _Failure(cp, [c[-1] for c in cand], work, own, view.labels, picks)
        if not cp.init or cp.sidecar:
            exclusive = cores >= EXCLUSIVE_CORES
            for p in picks:
                fm[p] -= cp.need(tmem[p])
                fc[p] -= cores
                fs[p] -= 1
                busy[p] = True
                if exclusive:
                    ex[p] = True
                own.add(p)
        chosen.append(picks)
    return chosen


def _best(
    cand: list[tuple[int, ...]], gpus: int, numa_bind: bool, numa: tuple[int, ...]
) -> list[int] | bool:
    """The positions of the best ``gpus`` candidates (each ending in its position; sorted
    here), or why there are none: False for too few, True for too few on any one NUMA node
    (numa-bind)."""
    if len(cand) < gpus:
        return False
    cand.sort()
    if numa_bind and gpus > 1:
        picks = _one_numa_node(cand, numa, gpus)
        return True if picks is None else picks
    return [c[-1] for c in cand[:gpus]]


def _one_numa_node(
    cand: list[tuple[int, ...]], numa: tuple[int, ...], gpus: int
) -> list[int] | None:
    """The first ``gpus`` candidates (in the policy's order) of the first NUMA node to offer
    that many; None when no NUMA node does."""
    seen: dict[int, list[int]] = {}
    for c in cand:
        p = c[-1]
        group = seen.setdefault(numa[p], [])
        group.append(p)
        if len(group) == gpus:
            return group
    return None


# ------------------------------------------------------------------------- MIG cards


class _MigFailure:
    """Where the MIG greedy stopped: the container, the cards that had a placement for it,
    and the memory slices taken on each card by then."""

    __slots__ = ("candidates", "container", "numa_split", "own", "used")

    def __init__(
        self,
        container: ContainerPlan,
        candidates: list[int],
        used: list[int],
        own: set[int],
        numa_split: bool = False,
    ) -> None:
        self.container = container
        self.candidates = candidates
        self.used = used
        self.own = own
        self.numa_split = numa_split


def _mig_profile(cp: ContainerPlan, geometry: MigGeometry, card_mib: int) -> MigProfile | None:
    """The profile one slice of ``cp`` takes on a card of this geometry: the one it names,
    else the smallest that holds its per-card memory (no memory asked: the smallest)."""
    if cp.mig_profile:
        return geometry.profile(cp.mig_profile)
    return profile_for(geometry, 0 if cp.kind == 2 else cp.need(card_mib))


# (position, profile, start) per slice of a container
_MigPicks = list[tuple[int, MigProfile, int]]


def _mig_greedy(
    view: NodeView, plan: Plan, allowed: tuple[bool, ...] | None
) -> list[_MigPicks] | _MigFailure:
    """Choose a card and a placement for every slice of every container on MIG cards.

    Each slice is one GPU instance on a distinct card of the container. A card is a
    candidate when the slice's profile (:func:`_mig_profile`) has a free placement there;
    the placement is the one that keeps the most room for the largest profiles
    (``mig.choose_start``); cards are taken by free memory slices left after placement,
    fewest first for binpack, most for spread, ties to the lower index (NUMA: as in
    :func:`_greedy`). Every container's instances take room, init containers' too: an
    instance is created for its container and lives until the pod's binding ends.
    """
    used = list(view.mig_used)
    geo, tmem = view.mig_geo, view.tmem
    binpack = plan.gpu_binpack
    order = plan.numa_order
    numa = view.numa if order or plan.numa_bind else ()
    own: set[int] = set()
    chosen: list[_MigPicks] = []
    for cp in plan.containers:
        cand: list[tuple[int, ...]] = []
        where: dict[int, tuple[MigProfile, int]] = {}
        for p in range(view.n):
            g = geo[p]
            if g is None or (allowed is not None and not allowed[p]):
                continue
            if cp.strict and used[p]:
                continue
            profile = _mig_profile(cp, g, tmem[p])
            if profile is None:
                continue
            start = choose_start(g, profile, used[p])
            if start is None:
                continue
            where[p] = (profile, start)
            left = free_slices(g, used[p] | profile.mask(start))
            room = left if binpack else -left
            cand.append((room, p) if not order else _numa_key(room, p, numa[p], order))
        picks = _best(cand, cp.gpus, plan.numa_bind, numa)
        if not isinstance(picks, list):
            return _MigFailure(cp, [c[-1] for c in cand], used, own, picks)
        placed: _MigPicks = []
        for p in picks:
            profile, start = where[p]
            used[p] |= profile.mask(start)
            own.add(p)
            placed.append((p, profile, start))
        chosen.append(placed)
    return chosen


def _numa_key(room: int, p: int, node: int, order: int) -> tuple[int, int, int]:
    """A candidate's sort key with its NUMA node before (order 1) or after the room."""
    return (node, room, p) if order == 1 else (room, node, p)


def _fits_mig(view: NodeView, plan: Plan) -> bool:
    """Whether the MIG lane of the node takes the pod (the MIG greedy itself: MIG nodes are
    few, and a card's placements do not reduce to one number)."""
    lane = view.lane(MIG)
    if lane is None or not lane.ok:
        return False
    return not isinstance(_mig_greedy(lane, plan, _allowed(lane, plan)), _MigFailure)


# --------------------------------------------------------------- cheaper equivalents


def _count(view: NodeView, cp: ContainerPlan, allowed: tuple[bool, ...] | None, enough: int) -> int:
    """Cards that could take one slice of ``cp`` on the node as it is (stops at ``enough``).

    Same test as the greedy's, on the initial state: ``fmem`` already folds "exclusive
    tenant", "no free slot" and "no compute left" into -1 MiB, which no need (>= 0) fits in.
    """
    kind, value, cores, strict = cp.kind, cp.value, cp.cores, cp.strict
    fmem, fcu, tmem, busy = view.fmem, view.fcu, view.tmem, view.busy
    found = 0
    for p in range(view.n):
        if allowed is not None and not allowed[p]:
            continue
        need = value if kind == 0 else tmem[p] * value // 100 if kind == 1 else tmem[p]
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

    Only meaningful when no app container is strict (the caller checks). ``stack_cores``
    keeps 1% over for an app container that asks 0% after the others took theirs (a card with
    no compute left refuses even that).
    """
    n_app = len(plan.apps)
    base, pcts, whole, cores = plan.stack_abs, plan.stack_pcts, plan.stack_whole, plan.stack_cores
    raw, fcu, fslots, excl, tmem = view.raw_fmem, view.fcu, view.fslots, view.excl, view.tmem
    found = 0
    for p in range(view.n):
        if allowed is not None and not allowed[p]:
            continue
        if excl[p] or fslots[p] < n_app or fcu[p] < cores:
            continue
        total = tmem[p]
        need = base + whole * total
        for pct in pcts:
            need += total * pct // 100
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
    apps = plan.abs_apps
    assert apps is not None
    max_mem, total_mem, slices = plan.app_max_mem, plan.app_total_mem, plan.app_slices
    max_cores, total_cores = plan.app_max_cores, plan.app_compute
    inits = plan.inits
    stack_mem, stack_cores, n_app = plan.stack_abs, plan.stack_cores, len(plan.apps)
    enough = plan.max_app_gpus
    binpack = plan.gpu_binpack

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
            return not isinstance(_greedy(view, plan, None), _Failure)
        fc_ = list(view.fcu)
        # A card takes at most one slice per app container: with that many free slots on
        # every live card, slots cannot run out and need no tracking.
        fs_ = list(view.fslots) if view.min_live_slots < n_app else None
        work = list(keys)
        # A picked card's key is rewritten in place as soon as it is picked: the scan never
        # returns to an index it passed, and the list is re-sorted once per container.
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
    allowed = _allowed(view, plan)
    if plan.greedy_only:
        return not isinstance(_greedy(view, plan, allowed), _Failure)
    for cp in plan.inits:
        if _count(view, cp, allowed, cp.gpus) < cp.gpus:
            return False
    apps = plan.apps
    if len(apps) == 1 and allowed is None and apps[0].kind == 0 and not apps[0].strict:
        only = apps[0]
        return _count_abs(view, only.value, only.cores, only.gpus) >= only.gpus
    if not apps:
        return True
    if len(apps) == 1:
        return _count(view, apps[0], allowed, apps[0].gpus) >= apps[0].gpus
    if not plan.stack_exclusive:
        enough = plan.max_app_gpus
        if _count_stack(view, plan, allowed, enough) >= enough:
            return True
    for cp in apps:
        if _count(view, cp, allowed, cp.gpus) < cp.gpus:
            return False
    return not isinstance(_greedy(view, plan, allowed), _Failure)


def _fitter(plan: Plan) -> _Fitter:
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
    if not plan.filtered:
        return base

    def filtered(view: NodeView) -> bool:
        mask = _allowed(view, plan)
        assert mask is not None
        if all(mask):
            return base(view)
        if not any(mask):
            return False
        return _fits_general(view, plan)

    return filtered


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
    if cp.kind == 0 and cores < EXCLUSIVE_CORES:
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


# ------------------------------------------------------------------------ explanations


def _who(cp: ContainerPlan) -> str:
    kind = "sidecar container" if cp.sidecar else "init container" if cp.init else "container"
    return f"{kind} '{cp.request.name}'"


def _card_name(card: CardState) -> str:
    return f"card {card.uuid} ({card.model})"


# The card modes as people read them, and as nvidia.com/vgpu-mode names them.
_MODE_LABEL = {SHARED: "shared", MIG: "MIG", "mps": "MPS", EXCLUSIVE: "exclusive"}
_VGPU_NAME = {SHARED: SHARED_MODE, MIG: "mig", "mps": "mps", EXCLUSIVE: SHARED_MODE}


def _mode_reason(card: CardState, plan: Plan, lane: str) -> Refusal | None:
    """Why the card's mode keeps the pod off it; None when the pod may use the card in its
    mode (in this lane, or in another the pod tries, which explains it there)."""
    name = _card_name(card)
    if card.draining:
        return Refusal(
            ReasonCode.CARD_DRAINING,
            f"{name} is draining for a mode change: it takes no new slices until its last one ends",
            card.uuid,
            False,
        )
    if card.mode in plan.lanes:
        if card.mode == MIG and lane == MIG and not card.mig_enabled:
            return Refusal(
                ReasonCode.MIG_NOT_ENABLED,
                f"{name} is in MIG mode, but MIG is not yet enabled on the GPU (the node plugin "
                "turns it on; some GPUs need a reset first)",
                card.uuid,
                True,
            )
        return None
    if card.mode == EXCLUSIVE and SHARED in plan.lanes:
        why = (
            "it takes only a slice that is the whole card (memory and compute 100%), which "
            "the pod does not ask"
        )
    else:
        why = f"the pod does not accept {_VGPU_NAME[card.mode]} (nvidia.com/vgpu-mode)"
    return Refusal(
        ReasonCode.MODE_MISMATCH,
        f"{name} is in {_MODE_LABEL[card.mode]} mode; {why}",
        card.uuid,
        True,
    )


def _static_reason(
    card: CardState, plan: Plan, request: PodRequest, lane: str = SHARED
) -> Refusal | None:
    """Reasons that hold whatever else runs on the card."""
    name = _card_name(card)
    if not card.healthy:
        why = card.health_reason or "no reason reported"
        return Refusal(ReasonCode.UNHEALTHY, f"{name} is unhealthy: {why}", card.uuid, True)
    if card.cordoned:
        return Refusal(
            ReasonCode.CARD_CORDONED, f"{name} is cordoned by an operator", card.uuid, True
        )
    if card.draining or card.mode != lane or (lane == MIG and not card.mig_enabled):
        mode = _mode_reason(card, plan, lane)
        if mode is not None:
            return mode
    if not plan.filtered:
        return None
    model_l = card.model.lower()
    if not plan.type_allowed(model_l):
        if request.use_types and not any(t in model_l for t in request.use_types):
            why = f"nvidia.com/use-gputype allows only {', '.join(request.use_types)}"
        else:
            hits = [t for t in request.nouse_types if t in model_l]
            why = f"nvidia.com/nouse-gputype excludes {', '.join(hits)}"
        return Refusal(ReasonCode.TYPE_EXCLUDED, f"{name} is excluded: {why}", card.uuid, True)
    uuid_l = card.uuid.lower()
    if plan.use_uuids and uuid_l not in plan.use_uuids:
        return Refusal(
            ReasonCode.UUID_EXCLUDED,
            f"{name} is not listed in the pod's nvidia.com/use-gpuuuid",
            card.uuid,
            True,
        )
    if uuid_l in plan.nouse_uuids:
        return Refusal(
            ReasonCode.UUID_EXCLUDED,
            f"{name} is listed in the pod's nvidia.com/nouse-gpuuuid",
            card.uuid,
            True,
        )
    return None


def _room_reason(card: CardState, p: int, failure: _Failure, who: str) -> Refusal:
    """Why the card at position ``p`` had no room for the failing container's slice."""
    cp = failure.container
    fm, fc, fs, busy, ex = failure.state
    name = failure.labels[p]
    need = cp.need(card.memory_mib)
    # When the pod's own earlier containers took room here, say so: otherwise the numbers
    # would not match what the dashboard shows for the card.
    note = " (after this pod's earlier containers)" if p in failure.own else ""
    if ex[p]:
        return Refusal(
            ReasonCode.EXCLUSIVE_CONFLICT,
            f"{name} is held exclusively by a slice with 100% compute{note}",
            card.uuid,
            False,
        )
    if cp.cores >= EXCLUSIVE_CORES and busy[p]:
        return Refusal(
            ReasonCode.EXCLUSIVE_CONFLICT,
            f"{who} asks for 100% compute (exclusive) but {name} already holds slices{note}",
            card.uuid,
            False,
        )
    if cp.strict and busy[p]:
        return Refusal(
            ReasonCode.EXCLUSIVE_CONFLICT,
            f"{name} already holds slices{note}; the pod's GPU policy is mutex (only cards "
            "that hold no slice)",
            card.uuid,
            False,
        )
    if fs[p] <= 0:
        if card.slots <= 0:
            msg = f"{name} takes no slices (0 slots)"
        else:
            msg = f"{name}: all {card.slots} slice slots are taken{note}"
        return Refusal(ReasonCode.NO_FREE_SLOT, msg, card.uuid, card.slots <= 0)
    if need > fm[p]:
        if need > card.memory_mib:
            return Refusal(
                ReasonCode.INSUFFICIENT_MEMORY,
                f"{name}: {who} needs {need} MiB, the card has {card.memory_mib} MiB in total",
                card.uuid,
                True,
            )
        return Refusal(
            ReasonCode.INSUFFICIENT_MEMORY,
            f"{name}: {who} needs {need} MiB, {max(fm[p], 0)} MiB free{note}",
            card.uuid,
            False,
        )
    if cp.cores > card.compute_units:
        return Refusal(
            ReasonCode.INSUFFICIENT_COMPUTE,
            f"{name}: {who} needs {cp.cores}% compute, the card has {card.compute_units} in total",
            card.uuid,
            True,
        )
    if cp.cores <= 0 < card.compute_units and fc[p] <= 0:
        return Refusal(
            ReasonCode.INSUFFICIENT_COMPUTE,
            f"{name}: all of its compute is booked (0% free{note}); {who} asks for no compute "
            "share (gpucores 0), which still needs some",
            card.uuid,
            False,
        )
    return Refusal(
        ReasonCode.INSUFFICIENT_COMPUTE,
        f"{name}: {who} needs {cp.cores}% compute, {max(fc[p], 0)}% free{note}",
        card.uuid,
        False,
    )


def _all_excluded(node: NodeState, plan: Plan, request: PodRequest) -> Refusal:
    """One refusal for a node whose every (schedulable) card the annotations exclude."""
    models = ", ".join(sorted({c.model for c in node.cards}))
    lowered = {c.model.lower() for c in node.cards}
    if not any(plan.type_allowed(m) for m in lowered):
        wanted = request.use_types
        if wanted and not any(t in m for m in lowered for t in wanted):
            why = f"nvidia.com/use-gputype allows only {', '.join(wanted)}"
        else:
            hits = [t for t in request.nouse_types if any(t in m for m in lowered)]
            why = f"nvidia.com/nouse-gputype excludes {', '.join(hits)}"
        return Refusal(
            ReasonCode.TYPE_EXCLUDED,
            f"node {node.name}: all {len(node.cards)} cards ({models}) are excluded: {why}",
            None,
            True,
        )
    return Refusal(
        ReasonCode.UUID_EXCLUDED,
        f"node {node.name}: all {len(node.cards)} cards are excluded by the pod's "
        "nvidia.com/use-gpuuuid / nouse-gpuuuid",
        None,
        True,
    )


def _ever_fits(card: CardState, cp: ContainerPlan) -> bool:
    """Whether an otherwise empty copy of this (schedulable, allowed) card could take a slice."""
    return (
        card.slots >= 1
        and cp.need(card.memory_mib) <= card.memory_mib
        and cp.cores <= card.compute_units
    )


def explain(node: NodeState, request: PodRequest) -> tuple[Refusal, ...]:
    """Every reason the pod does not fit ``node``, most useful first (empty if it fits).

    Runs the same greedy as :func:`place_on_node`; for the container where it stops, each
    card gets the first reason in the order documented in docs/scheduling.md. A pod that may
    use cards of several modes gets each lane's reasons (a card in a mode it does not accept
    is said once).
    """
    refusals: list[Refusal] = []
    if not node.ready:
        refusals.append(
            Refusal(
                ReasonCode.NODE_NOT_READY,
                f"node {node.name} is not ready (its Tessera node plugin is not reporting)",
                None,
                True,
            )
        )
    if node.cordoned:
        refusals.append(
            Refusal(
                ReasonCode.NODE_CORDONED,
                f"node {node.name} is cordoned in Tessera by an operator",
                None,
                True,
            )
        )
    if refusals:
        return tuple(refusals)
    if not node.cards:
        return (
            Refusal(
                ReasonCode.NO_CARDS,
                f"node {node.name} has no GPUs known to Tessera",
                None,
                True,
            ),
        )
    plan = request.plan
    if plan.shared_only:
        return _no_mode(node, request, _explain_lane(node, node.view, plan, request))
    found: dict[Refusal, None] = {}
    for mode in plan.lanes:
        # A lane the node has no card of is still walked: each card then says its mode.
        lane = node.view.lane(mode) or NodeView(node.ready, node.cordoned, node.cards, mode)
        explained = (
            _explain_mig(node, lane, plan, request)
            if mode == MIG
            else _explain_lane(node, lane, plan, request, mode)
        )
        if not explained:
            return ()
        found.update(dict.fromkeys(explained))
    return _no_mode(node, request, tuple(sorted(found, key=lambda r: r.permanent)))


def _no_mode(
    node: NodeState, request: PodRequest, refusals: tuple[Refusal, ...]
) -> tuple[Refusal, ...]:
    """One line for a node none of whose cards is in a mode the pod accepts."""
    if not refusals or any(r.code is not ReasonCode.MODE_MISMATCH for r in refusals):
        return refusals
    plan = request.plan
    if SHARED in plan.lanes and any(c.mode == EXCLUSIVE for c in node.cards):
        return refusals  # the per-card line says what an exclusive card would take
    wanted = " or ".join(dict.fromkeys(_MODE_LABEL[m] for m in plan.lanes if m != EXCLUSIVE))
    held = ", ".join(sorted({_MODE_LABEL[c.mode] for c in node.cards}))
    accepts = ", ".join(request.vgpu_modes) or SHARED_MODE
    return (
        Refusal(
            ReasonCode.MODE_MISMATCH,
            f"no card is in {wanted} mode: the pod's nvidia.com/vgpu-mode accepts {accepts}, "
            f"and the {len(node.cards)} card(s) of node {node.name} are in {held} mode",
            None,
            True,
        ),
    )


def _explain_mig(
    node: NodeState, view: NodeView, plan: Plan, request: PodRequest
) -> tuple[Refusal, ...]:
    """:func:`explain` on a node's MIG lane."""
    outcome = _mig_greedy(view, plan, _allowed(view, plan))
    if not isinstance(outcome, _MigFailure):
        return ()
    cp = outcome.container
    who = _who(cp)
    candidates = set(outcome.candidates)
    per_card: list[Refusal] = []
    for card, p in _room_cards(view, plan, request, MIG, per_card):
        if p not in candidates:
            per_card.append(_mig_room_reason(card, view.mig_geo[p], cp, outcome, p, who))
    refusals: list[Refusal] = []
    if outcome.numa_split:
        refusals.append(
            Refusal(
                ReasonCode.TOO_FEW_CARDS,
                f"{who} needs {cp.gpus} MIG cards with a free placement on one NUMA node "
                f"(nvidia.com/numa-bind); node {node.name} has {len(candidates)}, not on one "
                "NUMA node",
                None,
                False,
            )
        )
    elif candidates or not per_card:
        refusals.append(
            _too_few(who, cp.gpus, "MIG cards with a free placement", node, len(candidates))
        )
    return _then_cards(refusals, per_card)


def _too_few(who: str, gpus: int, what: str, node: NodeState, have: int) -> Refusal:
    return Refusal(
        ReasonCode.TOO_FEW_CARDS,
        f"{who} needs {gpus} distinct {what}; node {node.name} has {have} now",
        None,
        False,
    )


def _then_cards(refusals: list[Refusal], per_card: list[Refusal]) -> tuple[Refusal, ...]:
    """The node-wide refusals, then the per-card ones, those that waiting can fix first: they
    are what a person wants to see."""
    per_card.sort(key=lambda r: r.permanent)
    return (*refusals, *per_card)


def _mig_room_reason(
    card: CardState,
    geometry: MigGeometry | None,
    cp: ContainerPlan,
    failure: _MigFailure,
    p: int,
    who: str,
) -> Refusal:
    """Why a schedulable MIG card has no instance for the failing container's slice."""
    name = _card_name(card)
    if geometry is None:
        return Refusal(
            ReasonCode.NO_MIG_PLACEMENT,
            f"{name} is in MIG mode, but Tessera knows no MIG profiles of this model",
            card.uuid,
            True,
        )
    profile = _mig_profile(cp, geometry, card.memory_mib)
    if profile is None:
        if cp.mig_profile:
            why = f"the {geometry.name} has no {cp.mig_profile} profile"
        else:
            largest = max(geometry.profiles, key=lambda q: q.memory_mib)
            why = (
                f"{who} needs {cp.need(card.memory_mib)} MiB; the largest profile, "
                f"{largest.name}, has {largest.memory_mib} MiB"
            )
        return Refusal(ReasonCode.NO_MIG_PLACEMENT, f"{name}: MIG mode, {why}", card.uuid, True)
    note = " (after this pod's earlier containers)" if p in failure.own else ""
    if cp.strict and failure.used[p]:
        return Refusal(
            ReasonCode.EXCLUSIVE_CONFLICT,
            f"{name}: MIG mode, already holds instances{note}; the pod's GPU policy is mutex "
            "(only cards that hold no slice)",
            card.uuid,
            False,
        )
    return Refusal(
        ReasonCode.NO_MIG_PLACEMENT,
        f"{name}: MIG mode, no free {profile.name} placement{note}",
        card.uuid,
        False,
    )


def _room_cards(
    view: NodeView, plan: Plan, request: PodRequest, lane: str, per_card: list[Refusal]
) -> Iterator[tuple[CardState, int]]:
    """The cards of a lane's explanation that need a reason about room, with their positions.

    Unschedulable cards (p < 0) always have a static reason, schedulable ones only when the
    pod filters cards: those go straight into ``per_card``. A card of another lane the pod
    tries is skipped: that lane explains it.
    """
    for card, p in view.by_index:
        if p < 0 or plan.filtered:
            static = _static_reason(card, plan, request, lane)
            if static is not None:
                per_card.append(static)
                continue
            if p < 0:
                continue
        yield card, p


def _explain_lane(
    node: NodeState, view: NodeView, plan: Plan, request: PodRequest, lane: str = SHARED
) -> tuple[Refusal, ...]:
    """:func:`explain` on one lane of shared-style cards (shared, MPS or exclusive)."""
    refusals: list[Refusal] = []
    allowed = _allowed(view, plan)
    if (
        allowed is not None
        and len(node.cards) > 1
        and view.n == len(node.cards)
        and not any(allowed)
    ):
        # A node of the wrong model: one line says it better than one per card.
        return (_all_excluded(node, plan, request),)
    outcome = _greedy(view, plan, allowed)
    if not isinstance(outcome, _Failure):
        return ()
    cp = outcome.container
    who = _who(cp)
    candidates = set(outcome.candidates)
    ever = 0
    # numa-bind: cards by NUMA node, those that could ever hold the slice and those with room
    bound = plan.numa_bind and cp.gpus > 1
    ever_on: dict[int, int] = {}
    room_on: dict[int, int] = {}
    per_card: list[Refusal] = []
    for card, p in _room_cards(view, plan, request, lane, per_card):
        if _ever_fits(card, cp):
            ever += 1
            if bound:
                ever_on[view.numa[p]] = ever_on.get(view.numa[p], 0) + 1
        if p not in candidates:
            per_card.append(_room_reason(card, p, outcome, who))
        elif bound:
            room_on[view.numa[p]] = room_on.get(view.numa[p], 0) + 1
    need_cards = cp.gpus
    most = max(ever_on.values(), default=0)
    if bound and most < need_cards <= ever:
        refusals.append(
            Refusal(
                ReasonCode.TOO_FEW_CARDS,
                f"{who} needs {need_cards} cards on one NUMA node (nvidia.com/numa-bind); "
                f"node {node.name} has at most {most} on any one NUMA node that could ever "
                "hold its slice",
                None,
                True,
            )
        )
    # With no card able ever to hold the slice, the per-card reasons already say it all.
    elif ever < need_cards and (ever > 0 or not per_card):
        refusals.append(
            Refusal(
                ReasonCode.TOO_FEW_CARDS,
                f"{who} needs {need_cards} card(s) with {cp.request.describe_memory()} and "
                f"{cp.cores}% compute each; node {node.name} has {ever} that could ever hold one",
                None,
                True,
            )
        )
    elif outcome.numa_split:
        refusals.append(
            Refusal(
                ReasonCode.TOO_FEW_CARDS,
                f"{who} needs {need_cards} cards with room on one NUMA node "
                f"(nvidia.com/numa-bind); node {node.name} has {len(candidates)} with room, "
                f"at most {max(room_on.values(), default=0)} on any one NUMA node now",
                None,
                False,
            )
        )
    elif candidates:
        refusals.append(_too_few(who, need_cards, "cards with room", node, len(candidates)))
    return _then_cards(refusals, per_card)


# -------------------------------------------------------------------------- public API


def fit_node(node: NodeState, request: PodRequest) -> NodeFit:
    """Whether ``request`` fits ``node``; True exactly when :func:`place_on_node` succeeds."""
    if _fitter(request.plan)(node.view):
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
            outcome = _greedy(view, plan, _allowed(view, plan))
            if not isinstance(outcome, _Failure):
                return _assignments(view, plan, outcome, SHARED)
        return NodeFit(node.name, False, explain(node, request))
    for mode in plan.lanes:
        lane = node.view.lane(mode)
        if lane is None or not lane.ok:
            continue
        if mode == MIG:
            placed = _mig_greedy(lane, plan, _allowed(lane, plan))
            if not isinstance(placed, _MigFailure):
                return _mig_assignments(lane, plan, placed)
            continue
        outcome = _greedy(lane, plan, _allowed(lane, plan))
        if not isinstance(outcome, _Failure):
            return _assignments(lane, plan, outcome, mode)
    return NodeFit(node.name, False, explain(node, request))


def _assignments(
    view: NodeView, plan: Plan, outcome: list[list[int]], mode: str
) -> tuple[Assignment, ...]:
    out: list[Assignment] = []
    for cp, picks in zip(plan.containers, outcome, strict=True):
        c = cp.request
        for p in picks:
            card = view.cards[p]
            # Positional: keywords cost a third more, and every bind builds these.
            out.append(
                Assignment(
                    c.name, c.index, c.init, card.uuid, cp.need(card.memory_mib), c.cores,
                    c.sidecar, c.priority, mode,
                )
            )  # fmt: skip
    return tuple(out)


def _mig_assignments(
    view: NodeView, plan: Plan, outcome: list[_MigPicks]
) -> tuple[Assignment, ...]:
    out: list[Assignment] = []
    for cp, picks in zip(plan.containers, outcome, strict=True):
        c = cp.request
        for p, profile, start in picks:
            geometry = view.mig_geo[p]
            assert geometry is not None
            out.append(
                Assignment(
                    container_name=c.name,
                    container_index=c.index,
                    init=c.init,
                    card_uuid=view.cards[p].uuid,
                    memory_mib=profile.memory_mib,
                    cores=geometry.compute_percent(profile),
                    sidecar=c.sidecar,
                    priority=c.priority,
                    mode=MIG,
                    mig_profile=profile.name,
                    mig_start=start,
                    mig_size=profile.memory_slices,
                )
            )
    return tuple(out)


def _demand(plan: Plan, card_mib: int) -> int:
    """The pod's memory on a node whose cards average ``card_mib``, at its peak (Plan.peak:
    the app containers with the sidecars, or an init container with the sidecars before it)."""
    return plan.peak(lambda cp: cp.gpus * cp.need(card_mib))


def _score(view: NodeView, plan: Plan, demand: int | None) -> int:
    total = view.mem_total
    if total <= 0:
        return 0
    used = view.mem_used + (_demand(plan, view.avg_mem) if demand is None else demand)
    # round(10 * used / total), halves up, in integers; clamped for over-committed nodes.
    packed = min(10, max(0, (20 * used + total) // (2 * total)))
    return packed if plan.node_binpack else 10 - packed


def _fixed_demand(plan: Plan) -> int | None:
    """The pod's demand when it does not depend on card size (all absolute MiB)."""
    if all(cp.kind == 0 for cp in plan.containers):
        return _demand(plan, 0)
    return None


def _score_view(view: NodeView, plan: Plan) -> NodeView:
    """The cards a score counts: the first of the pod's lanes the node has cards in."""
    if plan.shared_only:
        return view
    for mode in plan.lanes:
        lane = view.lane(mode)
        if lane is not None and lane.n:
            return lane
    return view


def score_node(node: NodeState, request: PodRequest) -> int:
    """0..10 by ``request.node_policy`` (binpack: fuller after placement scores higher)."""
    plan = request.plan
    return _score(_score_view(node.view, plan), plan, _fixed_demand(plan))


def filter_nodes(
    snapshot: Snapshot, request: PodRequest, names: Iterable[str] | None = None
) -> tuple[list[str], list[NodeFit]]:
    """Split ``names`` (default: every node) into feasible names and infeasible NodeFits.

    Both keep the input order; names the snapshot does not know get an UNKNOWN_NODE refusal.
    """
    ranking = _ranking(request.plan)
    if ranking is not None:
        key, number, least = ranking
        good = snapshot.ranked(key, number).at_least(least)
        names = [n.name for n in snapshot.nodes] if names is None else list(names)
        feasible = [name for name in names if name in good]
        if len(feasible) == len(names):
            return feasible, []
        return feasible, _failed(snapshot, request, (n for n in names if n not in good))
    fits = _fitter(request.plan)
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


def _ranking(
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
    if plan.filtered or cp is None or not plan.shared_only or cp.strict or cp.kind == 2:
        return None
    if cp.kind == 0:
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
    best = None
    for fm, fc, tm in zip(view.fmem, view.fcu, view.tmem, strict=True):
        if fm >= 0 and fc >= cores:
            left = fm - tm * percent // 100
            if best is None or left > best:
                best = left
    return best


def prioritize(
    snapshot: Snapshot, request: PodRequest, names: Iterable[str]
) -> list[tuple[str, int]]:
    """``(name, score)`` for each name in order; unknown names score 0."""
    plan = request.plan
    fixed = _fixed_demand(plan)
    binpack = plan.node_binpack
    if not plan.shared_only:
        by = snapshot.by_name
        return [
            (name, _score(_score_view(node.view, plan), plan, fixed) if node else 0)
            for name in names
            for node in (by.get(name),)
        ]
    if fixed is not None:  # the score depends on the node and these two only: memoised
        key = ("score", fixed, binpack)
        scores = snapshot.remembered(key)
        if scores is not None:
            return [(name, scores[name]) for name in names]
    # Percent and whole-card asks depend on the node's card size; sizes repeat a lot.
    per_size: dict[int, int] = {}
    by_name = snapshot.by_name
    out: list[tuple[str, int]] = []
    # _score inlined: this loop runs for every feasible node of every cycle.
    for name in names:
        node = by_name.get(name)
        if node is None:
            out.append((name, 0))
            continue
        view = node.view
        total = view.mem_total
        if total <= 0:
            out.append((name, 0))
            continue
        demand = fixed
        if demand is None:
            demand = per_size.get(view.avg_mem)
            if demand is None:
                demand = per_size[view.avg_mem] = _demand(plan, view.avg_mem)
        packed = (20 * (view.mem_used + demand) + total) // (2 * total)
        packed = 0 if packed < 0 else 10 if packed > 10 else packed
        out.append((name, packed if binpack else 10 - packed))
    if fixed is not None:
        # Worked out here, in this loop, rather than node by node through the memo: a new
        # shape scores every feasible node at once, and the loop costs a third as much.
        snapshot.per_node(key, lambda node: _score(node.view, plan, fixed), 0).update(out)
    return out
