"""Why a pod does not fit a node: the sentences a person reads (docs/scheduling.md, section 7).

:func:`explain` reruns the placement greedy (placement.py) with its bookkeeping and, for the
container where it stops, gives each card the first reason in the documented order, with the
node-wide reasons first. The filter asks for it only when someone reads a refusal
(``NodeFit.deferred``).
"""

from __future__ import annotations

from collections.abc import Iterator

from controlplane.scheduling.claims import EXCLUSIVE_CORES
from controlplane.scheduling.memory import FACTOR_ONE, format_factor, resident_mib
from controlplane.scheduling.mig import MigGeometry
from controlplane.scheduling.placement import (
    Failure,
    MigFailure,
    allowed_cards,
    greedy,
    mig_greedy,
    mig_profile_on,
)
from controlplane.scheduling.request import (
    ANN_MEMORY_OVERSUBSCRIPTION,
    SHARED_MODE,
    CardFilter,
    ContainerPlan,
    Plan,
    PodRequest,
)
from controlplane.scheduling.result import ReasonCode, Refusal
from controlplane.scheduling.state import EXCLUSIVE, MIG, SHARED, CardState, NodeState, NodeView


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
    cards = plan.cards
    if cards is None:
        return None
    model_l = card.model.lower()
    if not cards.type_allowed(model_l):
        if request.use_types and not any(t in model_l for t in request.use_types):
            why = f"nvidia.com/use-gputype allows only {', '.join(request.use_types)}"
        else:
            hits = [t for t in request.nouse_types if t in model_l]
            why = f"nvidia.com/nouse-gputype excludes {', '.join(hits)}"
        return Refusal(ReasonCode.TYPE_EXCLUDED, f"{name} is excluded: {why}", card.uuid, True)
    uuid_l = card.uuid.lower()
    if cards.use_uuids and uuid_l not in cards.use_uuids:
        return Refusal(
            ReasonCode.UUID_EXCLUDED,
            f"{name} is not listed in the pod's nvidia.com/use-gpuuuid",
            card.uuid,
            True,
        )
    if uuid_l in cards.nouse_uuids:
        return Refusal(
            ReasonCode.UUID_EXCLUDED,
            f"{name} is listed in the pod's nvidia.com/nouse-gpuuuid",
            card.uuid,
            True,
        )
    return None


def _room_reason(card: CardState, p: int, failure: Failure, who: str, node: NodeState) -> Refusal:
    """Why the card at position ``p`` had no room for the failing container's slice."""
    cp = failure.container
    fm, fc, fs, busy, ex, _ = failure.state
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
    budget = _budget_reason(card, p, failure, who, node, note)
    if budget is not None:
        return budget
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


def _budget_reason(
    card: CardState, p: int, failure: Failure, who: str, node: NodeState, note: str
) -> Refusal | None:
    """Which budget of virtual device memory refused the slice (docs/virtual-memory.md):
    "resident memory", "virtual memory" or "host spill reserve"; None on a card that does not
    oversubscribe, or when memory is not what is short (the caller goes on). The resident
    budget is named first: it is the one a slice without the opt-in meets."""
    if card.mode != SHARED or (card.factor == FACTOR_ONE and card.used_resident_mib is None):
        return None
    cp = failure.container
    fm, budgets = failure.state[0], failure.state[5]
    name = failure.labels[p]
    need = cp.need(card.memory_mib)
    factor = card.factor
    if budgets is not None:
        rf, vf, spill_left = budgets.rf[p], budgets.vf[p], budgets.spill
    else:  # the slices placed so far were resident in full: both budgets lost the same
        rfree = card.memory_mib - card.resident_used
        vfree = card.virtual_mib - card.used_memory_mib
        taken = min(rfree, vfree) - fm[p]
        rf, vf, spill_left = rfree - taken, vfree - taken, 0
    resident = resident_mib(need, factor) if cp.oversub and budgets is not None else need
    if resident > rf:
        if cp.oversub and budgets is not None:
            why = f"{need} MiB / factor {format_factor(factor)}, rounded up"
        elif budgets is not None:
            why = "an init container's slice stays on the card in full"
        else:
            why = (
                f'a slice of a pod without {ANN_MEMORY_OVERSUBSCRIPTION}: "true" stays on the '
                "card in full"
            )
        return Refusal(
            ReasonCode.INSUFFICIENT_MEMORY,
            f"{name}: {who} needs {resident} MiB of resident memory ({why}), {max(rf, 0)} MiB "
            f"free of the card's {card.memory_mib} MiB{note}",
            card.uuid,
            resident > card.memory_mib,
        )
    if need > vf:
        total = card.virtual_mib
        return Refusal(
            ReasonCode.INSUFFICIENT_MEMORY,
            f"{name}: {who} needs {need} MiB of virtual memory, {max(vf, 0)} MiB free of "
            f"{total} MiB (oversubscription factor {format_factor(factor)} x "
            f"{card.memory_mib} MiB){note}",
            card.uuid,
            need > total,
        )
    spill = need - resident
    if spill > spill_left:
        reserve = node.spill_reserve_mib
        return Refusal(
            ReasonCode.INSUFFICIENT_MEMORY,
            f"{name}: {who} would spill {spill} MiB to host memory; the host spill reserve of "
            f"node {node.name} has {max(spill_left, 0)} MiB free of {reserve} MiB",
            card.uuid,
            spill > reserve,
        )
    return None


def _all_excluded(node: NodeState, cards: CardFilter, request: PodRequest) -> Refusal:
    """One refusal for a node whose every (schedulable) card the annotations exclude."""
    models = ", ".join(sorted({c.model for c in node.cards}))
    lowered = {c.model.lower() for c in node.cards}
    if not any(cards.type_allowed(m) for m in lowered):
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


def _ever_fits(card: CardState, cp: ContainerPlan, node: NodeState) -> bool:
    """Whether an otherwise empty copy of this (schedulable, allowed) card could take a slice
    (an opted-in slice on an oversubscribed shared card: within its virtual memory, its
    resident part within the card, its spill within the node's reserve)."""
    need = cp.need(card.memory_mib)
    if card.slots < 1 or cp.cores > card.compute_units:
        return False
    if cp.oversub and card.factor > FACTOR_ONE and card.mode == SHARED:
        resident = resident_mib(need, card.factor)
        return (
            need <= card.virtual_mib
            and resident <= card.memory_mib
            and need - resident <= node.spill_reserve_mib
        )
    return need <= card.memory_mib


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
    outcome = mig_greedy(view, plan, allowed_cards(view, plan))
    if not isinstance(outcome, MigFailure):
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
    failure: MigFailure,
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
    profile = mig_profile_on(cp, geometry, card.memory_mib)
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
        if p < 0 or plan.cards is not None:
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
    allowed = allowed_cards(view, plan)
    if (
        plan.cards is not None
        and allowed is not None
        and len(node.cards) > 1
        and view.n == len(node.cards)
        and not any(allowed)
    ):
        # A node of the wrong model: one line says it better than one per card.
        return (_all_excluded(node, plan.cards, request),)
    outcome = greedy(view, plan, allowed)
    if not isinstance(outcome, Failure):
        return ()
    cp = outcome.container
    who = _who(cp)
    candidates = set(outcome.candidates)
    ever = 0
    # numa-bind: cards by NUMA node, those that could ever hold the slice and those with room
    bound = plan.policy.numa_bind and cp.gpus > 1
    ever_on: dict[int, int] = {}
    room_on: dict[int, int] = {}
    per_card: list[Refusal] = []
    for card, p in _room_cards(view, plan, request, lane, per_card):
        if _ever_fits(card, cp, node):
            ever += 1
            if bound:
                ever_on[view.numa[p]] = ever_on.get(view.numa[p], 0) + 1
        if p not in candidates:
            per_card.append(_room_reason(card, p, outcome, who, node))
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
