"""The one placement algorithm: which card takes each slice of a pod on one node.

:func:`greedy` (shared-style cards: shared, MPS, exclusive) and :func:`mig_greedy` (MIG
cards) are the rules of docs/scheduling.md, sections 4 and 10, in code. Bind places with
them (``fit.place_on_node``); the filter's cheaper tests (fastcheck.py) are proved equal to
"the greedy succeeds", and the explanations (explain.py) rerun the greedy to say where it
stopped. They read the flat tuples of :class:`~controlplane.scheduling.state.NodeView`.
"""

from __future__ import annotations

from controlplane.scheduling.claims import EXCLUSIVE_CORES
from controlplane.scheduling.memory import FACTOR_ONE, WHOLE, resident_mib
from controlplane.scheduling.mig import (
    MigGeometry,
    MigProfile,
    choose_start,
    free_slices,
    profile_for,
)
from controlplane.scheduling.request import ContainerPlan, Plan, Policy
from controlplane.scheduling.result import Assignment
from controlplane.scheduling.state import MIG, NodeView


class Budgets:
    """The greedy's working state of virtual device memory (docs/virtual-memory.md), kept only
    for a pod that opted in on a node with a card whose factor is above 1: per card position
    the resident budget left (``rf``: the card's memory less its slices' resident parts), the
    virtual budget left (``vf``: f x memory less its slices' memory) and the factor, and the
    node's host spill reserve left (``spill``)."""

    __slots__ = ("factors", "rf", "spill", "vf")

    def __init__(self, view: NodeView) -> None:
        self.rf: list[int] = list(view.rfree)
        self.vf: list[int] = list(view.vfree)
        self.factors = view.factors
        self.spill = view.spill_free


# The working state of the greedy: per schedulable card position, free memory (for a slice
# that does not spill: the smaller of the card's two budgets), free compute, free slots, busy
# (holds any slice), exclusive (holds a 100%-compute slice); and the budgets of virtual
# device memory where they matter.
GreedyState = tuple[list[int], list[int], list[int], list[bool], list[bool], Budgets | None]


class Failure:
    """Where the greedy stopped: the container, the cards that still had room, the state.

    ``numa_split`` is True when enough cards had room but no NUMA node had enough of them
    (the pod asked for nvidia.com/numa-bind).
    """

    __slots__ = ("candidates", "container", "labels", "numa_split", "own", "state")

    def __init__(
        self,
        container: ContainerPlan,
        candidates: list[int],
        state: GreedyState,
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


def allowed_cards(view: NodeView, plan: Plan) -> tuple[bool, ...] | None:
    """Per card position, whether the include/exclude annotations let the pod use it.

    None when the pod has no such annotation. The type part depends only on the node's
    list of models, which repeats across a cluster, so it is memoised per plan; the uuid
    part is skipped with one C-level set test on nodes the uuid lists do not mention.
    """
    cards = plan.cards
    if cards is None:
        return None
    key = view.models_key
    mask = cards.mask_memo.get(key)
    if mask is None:
        mask = cards.mask_memo[key] = tuple(cards.type_allowed(m) for m in view.model_l)
    use, nouse = cards.use_uuids, cards.nouse_uuids
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


def greedy(
    view: NodeView, plan: Plan, allowed: tuple[bool, ...] | None
) -> list[list[int]] | Failure:
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
    budgets = Budgets(view) if plan.oversub and view.oversub else None
    work: GreedyState = (
        list(view.raw_fmem),
        list(view.fcu),
        list(view.fslots),
        list(view.busy),
        list(view.excl),
        budgets,
    )
    fm, fc, fs, busy, ex, _ = work
    own: set[int] = set()
    tmem, tcu = view.tmem, view.tcu
    policy = plan.policy
    binpack, order, numa_bind = policy.gpu_binpack, policy.numa_order, policy.numa_bind
    numa = view.numa if order or numa_bind else ()
    chosen: list[list[int]] = []
    for cp in plan.containers:
        # With budgets every container but an ordinary init container spills (the opt-in is
        # the pod's), and an init container leaves no trace: the budgets need no other update.
        if budgets is not None and cp.oversub:
            spilled = _spilling(view, cp, budgets, work, allowed, numa, own, policy)
            if isinstance(spilled, Failure):
                return spilled
            own.update(spilled)
            chosen.append(spilled)
            continue
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
        picks = _best(cand, cp.gpus, numa_bind, numa)
        if not isinstance(picks, list):
            return Failure(cp, [c[-1] for c in cand], work, own, view.labels, picks)
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


def _spilling(
    view: NodeView,
    cp: ContainerPlan,
    budgets: Budgets,
    work: GreedyState,
    allowed: tuple[bool, ...] | None,
    numa: tuple[int, ...],
    own: set[int],
    policy: Policy,
) -> list[int] | Failure:
    """The greedy's step for a container whose slices may spill (the pod opted in, the node has
    a card with a factor above 1): the same gates and the same policy order as any slice, with
    the three budgets in place of free memory. A card can take a slice of ``need`` MiB when
    ``need`` fits its virtual budget and ``resident_mib(need, f)`` its resident budget; the
    slice spills ``need - resident``, which the node's reserve must hold. The policy's room is
    the virtual budget left after the slice. Slices are placed one by one, best card first:
    the node's reserve shrinks with each, so a card whose spill no longer fits is passed over
    (with numa-bind, each NUMA node's candidates are gathered against the reserve alone)."""
    fm, fc, fs, busy, ex, _ = work
    rf, vf, factors = budgets.rf, budgets.vf, budgets.factors
    tmem, tcu = view.tmem, view.tcu
    binpack, order, numa_bind = policy.gpu_binpack, policy.numa_order, policy.numa_bind
    cores, strict = cp.cores, cp.strict
    cand: list[tuple[int, ...]] = []
    spills: dict[int, int] = {}
    for p in range(view.n):
        if allowed is not None and not allowed[p]:
            continue
        need = cp.need(tmem[p])
        resident = resident_mib(need, factors[p])
        spill = need - resident
        if (
            ex[p]
            or fs[p] <= 0
            or need > vf[p]
            or resident > rf[p]
            or spill > budgets.spill
            or cores > fc[p]
            or (not fc[p] and tcu[p])
            or (strict and busy[p])
        ):
            continue
        spills[p] = spill
        room = vf[p] - need if binpack else need - vf[p]
        cand.append((room, p) if not order else _numa_key(room, p, numa[p], order))
    cand.sort()
    gpus = cp.gpus
    grouped = numa_bind and gpus > 1
    gathered: dict[int, tuple[list[int], int]] = {}
    picks: list[int] | None = None
    for c in cand:
        p = c[-1]
        key = numa[p] if grouped else 0
        group, left = gathered.get(key, ([], budgets.spill))
        if spills[p] > left:
            continue
        group.append(p)
        gathered[key] = (group, left - spills[p])
        if len(group) == gpus:
            picks = group
            break
    if picks is None:
        split = grouped and len(cand) >= gpus
        return Failure(cp, [c[-1] for c in cand], work, own, view.labels, split)
    exclusive = cores >= EXCLUSIVE_CORES
    for p in picks:
        need = cp.need(tmem[p])
        resident = resident_mib(need, factors[p])
        rf[p] -= resident
        vf[p] -= need
        budgets.spill -= need - resident
        fm[p] = min(rf[p], vf[p])
        fc[p] -= cores
        fs[p] -= 1
        busy[p] = True
        if exclusive:
            ex[p] = True
    return picks


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


class MigFailure:
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


def mig_profile_on(cp: ContainerPlan, geometry: MigGeometry, card_mib: int) -> MigProfile | None:
    """The profile one slice of ``cp`` takes on a card of this geometry: the one it names,
    else the smallest that holds its per-card memory (no memory asked: the smallest)."""
    if cp.mig_profile:
        return geometry.profile(cp.mig_profile)
    return profile_for(geometry, 0 if cp.kind == WHOLE else cp.need(card_mib))


# (position, profile, start) per slice of a container
MigPicks = list[tuple[int, MigProfile, int]]


def mig_greedy(
    view: NodeView, plan: Plan, allowed: tuple[bool, ...] | None
) -> list[MigPicks] | MigFailure:
    """Choose a card and a placement for every slice of every container on MIG cards.

    Each slice is one GPU instance on a distinct card of the container. A card is a
    candidate when the slice's profile (:func:`mig_profile_on`) has a free placement there;
    the placement is the one that keeps the most room for the largest profiles
    (``mig.choose_start``); cards are taken by free memory slices left after placement,
    fewest first for binpack, most for spread, ties to the lower index (NUMA: as in
    :func:`greedy`). Every container's instances take room, init containers' too: an
    instance is created for its container and lives until the pod's binding ends.
    """
    used = list(view.mig_used)
    geo, tmem = view.mig_geo, view.tmem
    policy = plan.policy
    binpack, order, numa_bind = policy.gpu_binpack, policy.numa_order, policy.numa_bind
    numa = view.numa if order or numa_bind else ()
    own: set[int] = set()
    chosen: list[MigPicks] = []
    for cp in plan.containers:
        cand: list[tuple[int, ...]] = []
        where: dict[int, tuple[MigProfile, int]] = {}
        for p in range(view.n):
            g = geo[p]
            if g is None or (allowed is not None and not allowed[p]):
                continue
            if cp.strict and used[p]:
                continue
            profile = mig_profile_on(cp, g, tmem[p])
            if profile is None:
                continue
            start = choose_start(g, profile, used[p])
            if start is None:
                continue
            where[p] = (profile, start)
            left = free_slices(g, used[p] | profile.mask(start))
            room = left if binpack else -left
            cand.append((room, p) if not order else _numa_key(room, p, numa[p], order))
        picks = _best(cand, cp.gpus, numa_bind, numa)
        if not isinstance(picks, list):
            return MigFailure(cp, [c[-1] for c in cand], used, own, picks)
        placed: MigPicks = []
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


def assignments(
    view: NodeView, plan: Plan, outcome: list[list[int]], mode: str
) -> tuple[Assignment, ...]:
    out: list[Assignment] = []
    factors = view.factors if plan.oversub and view.oversub else None
    for cp, picks in zip(plan.containers, outcome, strict=True):
        c = cp.request
        for p in picks:
            card = view.cards[p]
            need = cp.need(card.memory_mib)
            # Positional, and the resident part only where it is below the slice: keywords cost
            # a third more, and every bind builds these.
            if factors is not None and cp.oversub and factors[p] > FACTOR_ONE:
                resident = resident_mib(need, factors[p])
                if resident < need:
                    out.append(
                        Assignment(
                            c.name, c.index, c.init, card.uuid, need, c.cores, c.sidecar,
                            c.priority, mode, "", 0, 0, resident,
                        )
                    )  # fmt: skip
                    continue
            out.append(
                Assignment(
                    c.name, c.index, c.init, card.uuid, need, c.cores, c.sidecar, c.priority,
                    mode,
                )
            )  # fmt: skip
    return tuple(out)


def mig_assignments(view: NodeView, plan: Plan, outcome: list[MigPicks]) -> tuple[Assignment, ...]:
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
