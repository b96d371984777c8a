from __future__ import annotations

import pytest

from nodeplugin import ids, resolve
from nodeplugin.allocation import Allocation, ContainerAllocation, SliceDevice
from nodeplugin.cards import Card
from nodeplugin.podresources import ContainerHolding
from nodeplugin.store import IssuedName

CARDS = {u: Card(u, i, "A100", 81920, i, 0) for i, u in enumerate(["GPU-a", "GPU-b", "GPU-c"])}


def held(pod: str, container: str, *device_ids: str, ns: str = "ns") -> ContainerHolding:
    return ContainerHolding(ns, pod, container, frozenset(device_ids))


def alloc(*containers: tuple[str, bool, list[str]], name: str = "p") -> Allocation:
    index = {True: 0, False: 0}
    out = []
    for cname, init, uuids in containers:
        out.append(
            ContainerAllocation(
                cname,
                index[init],
                init,
                tuple(SliceDevice(u, 100 + i, 10) for i, u in enumerate(uuids)),
            )
        )
        index[init] += 1
    return Allocation("uid", "ns", name, "n1", tuple(out))


def test_find_holder_exact_partial_and_none() -> None:
    listed = [
        held("p", "app", "GPU-a::0"),
        held("q", "app", "GPU-b::0", "GPU-c::1"),
        held("r", "x"),
    ]
    assert resolve.find_holder(["GPU-a::0"], listed) == resolve.Holder("ns", "p", "app")
    assert resolve.find_holder(["GPU-c::1", "GPU-b::0"], listed) == resolve.Holder("ns", "q", "app")
    # an init container held GPU-b::0 + GPU-a::3; only GPU-b::0 went on to q's app container
    assert resolve.find_holder(["GPU-b::0", "GPU-a::3"], listed) == resolve.Holder("ns", "q", None)
    with pytest.raises(resolve.ResolveError, match="no container the kubelet lists"):
        resolve.find_holder(["GPU-c::3"], listed)
    with pytest.raises(resolve.ResolveError, match="several pods"):
        resolve.find_holder(["GPU-a::0", "GPU-b::0", "GPU-c::3"], listed)


def test_plans_for_an_app_container_and_card_mismatch() -> None:
    a = alloc(("app", False, ["GPU-b", "GPU-a"]))
    dids = ids.parse_ids(["GPU-a::2", "GPU-b::0"], CARDS.keys(), 4)
    plans = resolve.plans_for(
        dids,
        a,
        resolve.Holder("ns", "p", "app"),
        [IssuedName("old", 1), IssuedName("new", 2)],
        CARDS,
    )
    assert [(p.name, p.container) for p in plans] == [("new", "app")]
    assert [d.card.uuid for d in plans[0].devices] == ["GPU-b", "GPU-a"]  # the record's order
    wrong = ids.parse_ids(["GPU-a::2", "GPU-c::0"], CARDS.keys(), 4)
    with pytest.raises(resolve.ResolveError, match="refusing rather than giving the wrong card"):
        resolve.plans_for(wrong, a, resolve.Holder("ns", "p", "app"), [IssuedName("n", 1)], CARDS)
    same_card = ids.parse_ids(["GPU-a::2", "GPU-a::0"], CARDS.keys(), 4)
    with pytest.raises(resolve.ResolveError, match="own card"):
        resolve.plans_for(
            same_card, a, resolve.Holder("ns", "p", "app"), [IssuedName("n", 1)], CARDS
        )
    with pytest.raises(resolve.ResolveError, match="allocated it none"):
        resolve.plans_for(dids, a, resolve.Holder("ns", "p", "other"), [IssuedName("n", 1)], CARDS)
    with pytest.raises(resolve.ResolveError, match="no Allocate call is on record"):
        resolve.plans_for(dids, a, resolve.Holder("ns", "p", "app"), [], CARDS)


def test_init_containers_take_the_earlier_names() -> None:
    a = alloc(("i0", True, ["GPU-a"]), ("i1", True, ["GPU-b"]), ("app", False, ["GPU-a"]))
    dids = ids.parse_ids(["GPU-a::1"], CARDS.keys(), 4)
    issued = [IssuedName("stale", 0), IssuedName("n-i0", 1), IssuedName("n-app", 2)]
    plans = resolve.plans_for(dids, a, resolve.Holder("ns", "p", "app"), issued, CARDS)
    assert [(p.name, p.container) for p in plans] == [("n-i0", "i0"), ("n-app", "app")]
    assert plans[0].devices[0].memory_mib == 100
    # only an init container holds them
    dids_b = ids.parse_ids(["GPU-b::1"], CARDS.keys(), 4)
    plans = resolve.plans_for(
        dids_b, a, resolve.Holder("ns", "p", None), [IssuedName("x", 1)], CARDS
    )
    assert [(p.name, p.container) for p in plans] == [("x", "i1")]
    with pytest.raises(resolve.ResolveError, match="no init container"):
        resolve.plans_for(
            ids.parse_ids(["GPU-c::1"], CARDS.keys(), 4),
            a,
            resolve.Holder("ns", "p", None),
            [IssuedName("x", 1)],
            CARDS,
        )


def sidecar_pod() -> Allocation:
    """init i0 on GPU-a, sidecar s1 on GPU-a, app on GPU-a: as the control plane records them."""
    return Allocation(
        "uid",
        "ns",
        "p",
        "n1",
        (
            ContainerAllocation("i0", 0, True, (SliceDevice("GPU-a", 100, 10),)),
            ContainerAllocation("s1", 1, True, (SliceDevice("GPU-a", 200, 10),), sidecar=True),
            ContainerAllocation("app", 0, False, (SliceDevice("GPU-a", 300, 10),)),
        ),
    )


def test_a_sidecar_is_paired_once_with_only_the_inits_before_it() -> None:
    """The kubelet lists a sidecar and hands its IDs on to no later container: the IDs the
    sidecar holds were i0's before (two Allocate names), the app's are its own (one)."""
    a = sidecar_pod()
    mine = ids.parse_ids(["GPU-a::1"], CARDS.keys(), 4)
    plans = resolve.plans_for(
        mine, a, resolve.Holder("ns", "p", "s1"), [IssuedName("n-i0", 1), IssuedName("n-s1", 2)],
        CARDS,
    )  # fmt: skip
    assert [(p.name, p.container) for p in plans] == [("n-i0", "i0"), ("n-s1", "s1")]
    assert [p.devices[0].memory_mib for p in plans] == [100, 200]
    app_ids = ids.parse_ids(["GPU-a::2"], CARDS.keys(), 4)
    plans = resolve.plans_for(
        app_ids, a, resolve.Holder("ns", "p", "app"), [IssuedName("n-app", 3)], CARDS
    )
    assert [(p.name, p.container) for p in plans] == [("n-app", "app")]
    assert plans[0].devices[0].memory_mib == 300


def test_pending_card_sets_see_a_sidecar_as_a_listed_container() -> None:
    a = sidecar_pod()
    assert resolve.pending_card_sets(a, [held("p", "s1"), held("p", "app")], 1) == [
        frozenset({"GPU-a"}), frozenset({"GPU-a"}), frozenset({"GPU-a"})
    ]  # fmt: skip
    # the sidecar has its IDs: i0 had them before it, so only the app still waits
    listed = [held("p", "s1", "GPU-a::0"), held("p", "app")]
    assert resolve.pending_card_sets(a, listed, 1) == [frozenset({"GPU-a"})]


def test_pending_card_sets_for_the_preferred_allocation() -> None:
    a = alloc(
        ("i0", True, ["GPU-c"]), ("app", False, ["GPU-a"]), ("two", False, ["GPU-a", "GPU-b"])
    )
    listed = [held("p", "app"), held("p", "two"), held("other", "app", "GPU-b::0")]
    assert resolve.pending_card_sets(a, listed, 1) == [frozenset({"GPU-c"}), frozenset({"GPU-a"})]
    assert resolve.pending_card_sets(a, listed, 2) == [frozenset({"GPU-a", "GPU-b"})]
    listed = [held("p", "app", "GPU-a::0"), held("p", "two")]
    assert resolve.pending_card_sets(a, listed, 1) == []  # init done once an app container has IDs
