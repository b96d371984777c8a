"""Exact pod resolution: from the device IDs of a PreStartContainer call to the containers and
allocations they belong to. No node lock and no guessing: the kubelet's PodResources API says
which pod and container hold the IDs, the allocation record says what they get, and anything
that does not match is refused with a message.

Init containers: ordinary init containers are not listed by PodResources, and the kubelet
reuses an init container's device IDs for the container that follows (an app container, or a
sidecar: a restartable init container, which is listed like an app container and keeps its IDs
to itself, so none are handed on from a sidecar). So one set of IDs may
have been given to several containers of one pod, each through its own Allocate call (and own
name). The names Allocate issued for a set of IDs are kept (:mod:`nodeplugin.store`); the
newest ``k`` of them belong, in the kubelet's Allocate order (init containers by index, then the
app container), to the ``k`` containers of the holding pod whose allocated cards are the cards
of those IDs. Every PreStartContainer for the IDs writes all of them, so whichever container is
starting finds its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from nodeplugin import ids
from nodeplugin.allocation import Allocation, ContainerAllocation
from nodeplugin.cards import Card
from nodeplugin.edits import ContainerPlan, make_plan
from nodeplugin.podresources import ContainerHolding
from nodeplugin.store import IssuedName

log = logging.getLogger(__name__)


class ResolveError(RuntimeError):
    """The IDs cannot be tied to exactly one pod's record, or the record does not match them."""


@dataclass(frozen=True)
class Holder:
    namespace: str
    pod: str
    container: str | None  # None: only an (unlisted) init container holds the IDs


def find_holder(ids_: Sequence[str], listed: Sequence[ContainerHolding]) -> Holder:
    """The listed container holding exactly these IDs; else the one pod whose containers hold
    some of them (the rest went to an unlisted init container)."""
    want = frozenset(ids_)
    exact = [c for c in listed if c.device_ids == want]
    if len(exact) > 1:
        where = ", ".join(f"{c.namespace}/{c.pod}:{c.container}" for c in exact)
        raise ResolveError(f"device IDs {sorted(want)} are listed for several containers: {where}")
    if exact:
        c = exact[0]
        return Holder(c.namespace, c.pod, c.container)
    partial = {(c.namespace, c.pod) for c in listed if c.device_ids & want}
    if len(partial) == 1:
        ns, pod = next(iter(partial))
        return Holder(ns, pod, None)
    if partial:
        raise ResolveError(
            f"device IDs {sorted(want)} are spread over several pods: "
            f"{', '.join(f'{n}/{p}' for n, p in sorted(partial))}"
        )
    raise ResolveError(
        f"no container the kubelet lists holds device IDs {sorted(want)}; an ordinary init "
        "container whose pod's app containers hold none of its GPU slots cannot be resolved "
        "(give the GPU to an app or sidecar container, or the same cards to both)"
    )


def targets(alloc: Allocation, holder: Holder, cards: frozenset[str]) -> list[ContainerAllocation]:
    """The pod's containers that received these IDs, in the kubelet's Allocate order."""
    inits = [c for c in alloc.kubelet_order() if c.init and not c.sidecar and c.card_set == cards]
    if holder.container is None:
        if not inits:
            raise ResolveError(
                f"pod {alloc.namespace}/{alloc.name}: no init container is allocated the cards "
                f"{sorted(cards)} that the kubelet's device IDs are on"
            )
        return inits
    app = alloc.container(holder.container)
    if app is None:
        raise ResolveError(
            f"container {holder.container!r} of pod {alloc.namespace}/{alloc.name} holds GPU "
            "slots but the control plane allocated it none; refusing"
        )
    if app.card_set != cards:
        raise ResolveError(
            f"container {holder.container!r} of pod {alloc.namespace}/{alloc.name}: the kubelet "
            f"gave it slots on cards {sorted(cards)} but the control plane allocated "
            f"{sorted(app.card_set)}; refusing rather than giving the wrong card"
        )
    if app.init:
        # A sidecar holds them: only ordinary init containers before it can have had them.
        inits = [c for c in inits if c.index < app.index]
    return [*inits, app]


def pair_names(
    issued: Sequence[IssuedName], containers: Sequence[ContainerAllocation]
) -> list[tuple[str, ContainerAllocation]]:
    """The newest names go to the latest containers (see the module docstring)."""
    if not issued:
        raise ResolveError(
            "no Allocate call is on record for these device IDs (state directory lost?); "
            "delete the pod so the kubelet allocates again"
        )
    k = min(len(issued), len(containers))
    return list(zip([n.name for n in issued[-k:]], containers[-k:], strict=True))


def plans_for(
    device_ids: Sequence[ids.DeviceId],
    alloc: Allocation,
    holder: Holder,
    issued: Sequence[IssuedName],
    cards: Mapping[str, Card],
) -> list[ContainerPlan]:
    card_counts = ids.cards_of(device_ids)
    if any(n > 1 for n in card_counts.values()):
        raise ResolveError(
            f"the kubelet gave {len(device_ids)} slots on only {len(card_counts)} card(s) "
            f"({', '.join(ids.canonical(device_ids))}); each slice must be on its own card"
        )
    chosen = targets(alloc, holder, frozenset(card_counts))
    return [
        make_plan(name, c, cards, namespace=alloc.namespace, pod=alloc.name, pod_uid=alloc.pod_uid)
        for name, c in pair_names(issued, chosen)
    ]


def pending_card_sets(
    alloc: Allocation, listed: Sequence[ContainerHolding], size: int
) -> list[frozenset[str]]:
    """For GetPreferredAllocation: card sets of this pod's containers that still wait for
    devices and ask for ``size`` slices, in the kubelet's Allocate order."""
    held = {
        c.container: c.device_ids
        for c in listed
        if (c.namespace, c.pod) == (alloc.namespace, alloc.name)
    }
    # Sidecars are listed like app containers; once any listed container has IDs, the
    # ordinary init containers before it have had theirs.
    listed_allocated = any(held.get(c.name) for c in alloc.containers if c.sidecar or not c.init)
    out: list[frozenset[str]] = []
    for c in alloc.kubelet_order():
        if len(c.devices) != size:
            continue
        if c.init and not c.sidecar:
            if not listed_allocated:
                out.append(c.card_set)
        elif c.name in held and not held[c.name]:
            out.append(c.card_set)
    return out
