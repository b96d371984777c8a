"""Property tests: random clusters and requests against the documented rules.

The reference model below re-states docs/scheduling.md in the plainest code possible (one
card, one slice, one check at a time) so that the fast paths in fastcheck.py are checked against
the rules, not against themselves.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.scheduling import (
    Assignment,
    CardState,
    ContainerRequest,
    NodeFit,
    NodeState,
    PodRequest,
    Snapshot,
    claims_per_card,
    filter_nodes,
    fit_node,
    least_demand,
    parse_pod,
    place_on_node,
    prioritize,
    score_node,
    usage_of,
)
from controlplane.scheduling import fit as fit_module
from controlplane.scheduling.memo import MEMO_KEYS, RANK_KEYS, STALE_NAMES
from tests.pods import container as k8s_container
from tests.scheduling.builders import card, pod_json
from tests.scheduling.builders import node as build_node

PROFILE = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

MODELS = ("NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA L4", "Tesla T4")
TYPE_WORDS = ("a100", "l4", "t4", "nvidia", "h100", "80gb")


@st.composite
def cards(draw: st.DrawFn, prefix: str) -> tuple[CardState, ...]:
    count = draw(st.integers(0, 6))
    indexes = draw(st.permutations(list(range(count))))
    out = []
    for i in range(count):
        memory = draw(st.sampled_from((0, 100, 4000, 10000, 24576, 40960, 81920)))
        compute = draw(st.sampled_from((100, 100, 100, 50)))
        slots = draw(st.integers(0, 4))
        # Usage mostly within capacity, sometimes over it (a card that shrank, say).
        used_slots = draw(st.integers(0, slots + 1))
        used_memory = draw(st.integers(0, memory + 2000)) if used_slots else 0
        used_compute = draw(st.sampled_from((0, 10, 30, 50, 90, 100, 120))) if used_slots else 0
        out.append(
            CardState(
                uuid=f"GPU-{prefix}-{i}",
                index=indexes[i],
                model=draw(st.sampled_from(MODELS)),
                memory_mib=memory,
                compute_units=compute,
                slots=slots,
                numa_node=draw(st.sampled_from((0, 0, 1, 1, 2, None))),
                healthy=draw(st.integers(0, 5)) != 0,
                health_reason="XID 48",
                cordoned=draw(st.integers(0, 9)) == 0,
                used_memory_mib=used_memory,
                used_compute=used_compute,
                used_slots=used_slots,
                exclusive=used_slots > 0 and draw(st.integers(0, 6)) == 0,
            )
        )
    return tuple(out)


@st.composite
def nodes(draw: st.DrawFn, name: str = "n0") -> NodeState:
    return NodeState(
        name=name,
        ready=draw(st.integers(0, 15)) != 0,
        cordoned=draw(st.integers(0, 15)) == 0,
        cards=draw(cards(name)),
    )


@st.composite
def containers(draw: st.DrawFn) -> tuple[ContainerRequest, ...]:
    count = draw(st.integers(1, 4))
    out = []
    counters = {True: 0, False: 0}
    for i in range(count):
        init = draw(st.integers(0, 4)) == 0
        kind = draw(st.sampled_from(("abs", "abs", "abs", "pct", "whole")))
        out.append(
            ContainerRequest(
                name=f"c{i}",
                index=counters[init],
                init=init,
                gpus=draw(st.integers(1, 3)),
                memory_mib=(
                    draw(st.sampled_from((1, 500, 1000, 4000, 10000, 30000, 50000)))
                    if kind == "abs"
                    else None
                ),
                memory_percent=draw(st.integers(1, 100)) if kind == "pct" else None,
                cores=draw(st.sampled_from((0, 0, 0, 10, 30, 50, 100))),
                sidecar=init and draw(st.booleans()),
                priority=draw(st.sampled_from((None, None, 0, 1))),
            )
        )
        counters[init] += 1
    # Kubernetes lists init containers first; so does parse_pod.
    return tuple(sorted(out, key=lambda c: not c.init))


@st.composite
def requests(draw: st.DrawFn) -> PodRequest:
    filtered = draw(st.booleans())
    uuids = [f"gpu-n{n}-{i}" for n in range(3) for i in range(6)]

    def some(pool: list[str] | tuple[str, ...]) -> tuple[str, ...]:
        if not filtered:
            return ()
        return tuple(draw(st.lists(st.sampled_from(pool), max_size=2, unique=True)))

    return PodRequest(
        uid="u",
        namespace="ns",
        name="p",
        containers=draw(containers()),
        use_types=some(TYPE_WORDS),
        nouse_types=some(TYPE_WORDS),
        use_uuids=some(uuids),
        nouse_uuids=some(uuids),
        node_policy=draw(st.sampled_from(("binpack", "spread"))),
        gpu_policy=draw(st.sampled_from(GPU_POLICIES)),
        numa_bind=draw(st.integers(0, 3)) == 0,
        vgpu_modes=draw(
            st.sampled_from(((),) * 8 + (("hami-core",), ("mig",), ("mps", "hami-core")))
        ),
    )


# binpack/spread mostly, HAMi's chains now and then.
GPU_POLICIES = ("binpack", "spread") * 3 + (
    "mutex,binpack", "mutex,spread", "numa,binpack", "binpack,numa", "numa,spread",
    "spread,numa", "topology-aware,binpack", "numa,mutex,spread",
)  # fmt: skip

NEEDS = (1, 500, 1000, 4000, 5000, 10000, 20000)


@st.composite
def tight_nodes(draw: st.DrawFn) -> NodeState:
    """Healthy, ready nodes whose free room sits right at typical asks (edges matter)."""
    count = draw(st.integers(2, 8))
    out = []
    for i in range(count):
        memory = draw(st.sampled_from((10000, 24576, 40960)))
        free = min(memory, draw(st.sampled_from((0, 4000, 5000, 8000, 10000, 10000, 15000, 20000))))
        slots = draw(st.integers(1, 4))
        used_slots = draw(st.integers(0, slots))
        out.append(
            CardState(
                uuid=f"GPU-t-{i}",
                index=i,
                model=MODELS[i % 2],
                memory_mib=memory,
                compute_units=100,
                slots=slots,
                numa_node=draw(st.sampled_from((0, 1))),
                healthy=True,
                health_reason="",
                cordoned=False,
                used_memory_mib=memory - free,
                used_compute=100 - draw(st.sampled_from((0, 10, 30, 50, 60, 100, 100))),
                used_slots=used_slots,
                exclusive=used_slots > 0 and draw(st.integers(0, 9)) == 0,
            )
        )
    return NodeState("t", True, False, tuple(out))


@st.composite
def fast_requests(draw: st.DrawFn) -> PodRequest:
    """The shapes the filter's fast paths take: one slice, or 2-4 absolute app containers."""
    shape = draw(st.sampled_from(("single", "multi", "multi", "multi-init")))
    count = 1 if shape == "single" else draw(st.integers(2, 4))
    asks = [
        ContainerRequest(
            name=f"c{i}",
            index=i,
            init=False,
            gpus=1 if shape == "single" else draw(st.integers(1, 3)),
            memory_mib=draw(st.sampled_from(NEEDS[2:])),
            memory_percent=None,
            cores=draw(st.sampled_from((0, 0, 10, 30, 50))),
        )
        for i in range(count)
    ]
    if shape == "multi-init":
        need, sidecar = draw(st.sampled_from(NEEDS)), draw(st.booleans())
        asks.insert(0, ContainerRequest("w", 0, True, 1, need, None, 10, sidecar=sidecar))
    # Filters that allow every card of a tight node, none, or some (models alternate).
    return PodRequest(
        uid="u",
        namespace="ns",
        name="p",
        containers=tuple(asks),
        use_types=draw(st.sampled_from(((), (), ("a100",), ("80gb",), ("l4",)))),
        nouse_uuids=draw(st.sampled_from(((), (), ("gpu-t-0",), ("gpu-x",)))),
        node_policy="binpack",
        gpu_policy=draw(st.sampled_from(GPU_POLICIES)),
        numa_bind=draw(st.integers(0, 5)) == 0,
    )


# ------------------------------------------------------------ reference model


def allowed(card: CardState, request: PodRequest) -> bool:
    model = card.model.lower()
    uuid = card.uuid.lower()
    if request.use_types and not any(t in model for t in request.use_types):
        return False
    if any(t in model for t in request.nouse_types):
        return False
    if request.use_uuids and uuid not in request.use_uuids:
        return False
    return uuid not in request.nouse_uuids


Key = tuple[int, ...]
# free memory, free compute, free slots, busy, exclusive: per card uuid
State = tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, bool], dict[str, bool]]


def card_key(c: CardState, cont: ContainerRequest, free: dict[str, int], words: list[str]) -> Key:
    """The policy's order: binpack/spread on the memory left, numa on the NUMA node, in the
    order the policy names them, then the card index."""
    after = free[c.uuid] - cont.memory_on(c.memory_mib)
    parts = {
        "binpack": after,
        "spread": -after,
        "numa": 1 << 30 if c.numa_node is None else c.numa_node,
    }
    return (*(parts[w] for w in words if w in parts), c.index)


def options(
    node: NodeState,
    request: PodRequest,
    cont: ContainerRequest,
    state: State,
    mutex: bool,
    mine: list[str],
) -> list[CardState]:
    """The cards that can take one more slice of ``cont`` now."""
    f, cu, sl, bz, ex = state
    out = []
    for c in node.cards:
        need = cont.memory_on(c.memory_mib)
        if (
            c.uuid in mine
            or not c.healthy
            or c.cordoned
            or not allowed(c, request)
            or ex[c.uuid]
            or ((cont.cores == 100 or mutex) and bz[c.uuid])
            or sl[c.uuid] <= 0
            or need > f[c.uuid]
            or cont.cores > cu[c.uuid]
            # no compute left: not even a 0% slice (HAMi's rule)
            or (cu[c.uuid] <= 0 and c.compute_units > 0)
        ):
            continue
        out.append(c)
    return out


def reference_placement(
    node: NodeState, request: PodRequest
) -> dict[tuple[bool, int], list[str]] | None:
    """Slice by slice, as docs/scheduling.md says; None when some slice finds no card."""
    if not node.ready or node.cordoned:
        return None
    if request.vgpu_modes and "hami-core" not in request.vgpu_modes:
        return None  # every Tessera card shares by slices
    words = request.gpu_policy.split(",")
    mutex = "mutex" in words
    free = {c.uuid: c.memory_mib - c.used_memory_mib for c in node.cards}
    compute = {c.uuid: c.compute_units - c.used_compute for c in node.cards}
    slots = {c.uuid: c.slots - c.used_slots for c in node.cards}
    busy = {c.uuid: c.busy for c in node.cards}
    exclusive = {c.uuid: c.exclusive for c in node.cards}
    chosen: dict[tuple[bool, int], list[str]] = {}
    for cont in request.containers:
        if cont.init and not cont.sidecar:
            # An ordinary init container sees the node with the sidecars started so far, and
            # leaves nothing behind: copies, thrown away afterwards.
            f, cu, sl = dict(free), dict(compute), dict(slots)
            bz, ex = dict(busy), dict(exclusive)
        else:
            f, cu, sl, bz, ex = free, compute, slots, busy, exclusive

        state = (f, cu, sl, bz, ex)

        def key(c: CardState, cont: ContainerRequest = cont, f: dict[str, int] = f) -> Key:
            return card_key(c, cont, f, words)

        mine: list[str] = []
        if request.numa_bind and cont.gpus > 1:
            # Each NUMA node's best cards; the node whose last needed card comes first wins.
            groups: dict[int | None, list[CardState]] = defaultdict(list)
            for c in options(node, request, cont, state, mutex, []):
                groups[c.numa_node].append(c)
            complete = [sorted(g, key=key)[: cont.gpus] for g in groups.values()]
            complete = [g for g in complete if len(g) == cont.gpus]
            if not complete:
                return None
            picks = min(complete, key=lambda g: key(g[-1]))
        else:
            picks = []
            for _ in range(cont.gpus):
                found = options(node, request, cont, state, mutex, [c.uuid for c in picks])
                if not found:
                    return None
                picks.append(min(found, key=key))
        for best in picks:
            mine.append(best.uuid)
            f[best.uuid] -= cont.memory_on(best.memory_mib)
            cu[best.uuid] -= cont.cores
            sl[best.uuid] -= 1
            bz[best.uuid] = True
            if cont.cores == 100:
                ex[best.uuid] = True
        chosen[(cont.init, cont.index)] = mine
    return chosen


def emptied(node: NodeState) -> NodeState:
    """The same node with every slice gone (health, cordons, sizes unchanged)."""
    return NodeState(
        node.name,
        node.ready,
        node.cordoned,
        tuple(
            CardState(
                c.uuid,
                c.index,
                c.model,
                c.memory_mib,
                c.compute_units,
                c.slots,
                c.numa_node,
                c.healthy,
                c.health_reason,
                c.cordoned,
            )
            for c in node.cards
        ),
    )


# ------------------------------------------------------------------- properties


def check_against_reference(node: NodeState, request: PodRequest) -> None:
    """fit_node, place_on_node and the reference model give the same verdict and cards."""
    fit = fit_node(node, request)
    placed = place_on_node(node, request)
    expected = reference_placement(node, request)
    assert fit.feasible == (not isinstance(placed, NodeFit))
    assert fit.feasible == (expected is not None)
    if expected is None:
        assert isinstance(placed, NodeFit)
        assert placed.refusals == fit.refusals
        assert fit.refusals
        assert all(r.message.strip() for r in fit.refusals)
        assert fit.summary()
        return
    assert not isinstance(placed, NodeFit)
    got: dict[tuple[bool, int], list[str]] = defaultdict(list)
    for a in placed:
        got[(a.init, a.container_index)].append(a.card_uuid)
    # binpack / spread pick exactly the documented card for every slice, in order.
    assert dict(got) == expected


def check_limits(node: NodeState, request: PodRequest) -> None:
    """A placement never overfills a card and honours distinctness and filters."""
    placed = place_on_node(node, request)
    if isinstance(placed, NodeFit):
        return
    assert node.ready and not node.cordoned
    by_uuid = {c.uuid: c for c in node.cards}
    per_container: dict[tuple[bool, int], list[Assignment]] = defaultdict(list)
    for a in placed:
        per_container[(a.init, a.container_index)].append(a)
    for cont in request.containers:
        mine = per_container[(cont.init, cont.index)]
        assert len(mine) == cont.gpus
        assert len({a.card_uuid for a in mine}) == cont.gpus  # distinct cards
        for a in mine:
            card = by_uuid[a.card_uuid]
            assert card.healthy and not card.cordoned
            assert allowed(card, request)
            assert a.memory_mib == cont.memory_on(card.memory_mib)
            assert a.cores == cont.cores
            assert a.container_name == cont.name
    claims = claims_per_card(a.to_claim() for a in placed)
    for uuid, claim in claims.items():
        card = by_uuid[uuid]
        assert card.used_memory_mib + claim.memory_mib <= card.memory_mib
        assert card.used_compute + claim.cores <= card.compute_units
        assert card.used_slots + claim.slots <= card.slots
        assert not card.exclusive
        if claim.exclusive:
            assert not card.busy
    # An exclusive app (or sidecar) slice shares its card with no other such slice of the pod;
    # under mutex no two of them share a card, and every card used held nothing before.
    apps_on: dict[str, list[Assignment]] = defaultdict(list)
    for a in placed:
        if not a.init or a.sidecar:
            apps_on[a.card_uuid].append(a)
    mutex = "mutex" in request.gpu_policy.split(",")
    for slices in apps_on.values():
        if mutex or any(a.cores >= 100 for a in slices):
            assert len(slices) == 1
    if mutex:
        assert not any(by_uuid[a.card_uuid].busy for a in placed)
    # numa-bind: each container's cards on one NUMA node.
    if request.numa_bind:
        for mine in per_container.values():
            assert len({by_uuid[a.card_uuid].numa_node for a in mine}) == 1
    # A card with compute units and none left took no slice.
    for a in placed:
        card = by_uuid[a.card_uuid]
        assert card.compute_units <= 0 or card.used_compute < card.compute_units
    # What the pod counts against its quota is at least the core's lower bound.
    smallest = min(c.memory_mib for c in node.cards)
    assert usage_of(claims) >= least_demand(request, smallest)


@PROFILE
@given(node=nodes(), request=requests())
def test_fit_agrees_with_placement_and_the_reference(node: NodeState, request: PodRequest) -> None:
    check_against_reference(node, request)


@PROFILE
@given(node=nodes(), request=requests())
def test_placement_respects_every_card_limit(node: NodeState, request: PodRequest) -> None:
    check_limits(node, request)


@settings(PROFILE, max_examples=1500)
@given(node=tight_nodes(), request=fast_requests())
def test_fast_paths_agree_with_the_reference(node: NodeState, request: PodRequest) -> None:
    check_against_reference(node, request)
    check_limits(node, request)


@PROFILE
@given(node=nodes(), request=requests())
def test_permanent_means_an_empty_node_would_not_help(node: NodeState, request: PodRequest) -> None:
    fit = fit_node(node, request)
    if fit.feasible or not fit.permanent:
        return
    assert isinstance(place_on_node(emptied(node), request), NodeFit)


@PROFILE
@given(
    cluster=st.lists(st.integers(0, 5), min_size=0, max_size=4, unique=True).flatmap(
        lambda ids: st.tuples(*(nodes(f"n{i}") for i in ids))
    ),
    request=requests(),
    names=st.lists(st.sampled_from(["n0", "n1", "n2", "n3", "n4", "n5", "x"]), max_size=8),
)
def test_filter_and_prioritize_answer_only_for_input_names(
    cluster: tuple[NodeState, ...], request: PodRequest, names: list[str]
) -> None:
    snap = Snapshot.build(cluster)
    feasible, failed = filter_nodes(snap, request, names)
    assert set(feasible) <= set(names)
    assert {f.node for f in failed} <= set(names)
    # Every input name is answered once, in input order, as exactly one of the two.
    verdict = {n: True for n in feasible} | {f.node: False for f in failed}
    assert [n for n in names if verdict[n]] == feasible
    assert [n for n in names if not verdict[n]] == [f.node for f in failed]
    for name in names:
        known = snap.by_name.get(name)
        assert verdict[name] == (known is not None and fit_node(known, request).feasible)
    for f in failed:
        assert f.refusals and all(r.message for r in f.refusals)
    scores = prioritize(snap, request, feasible)
    assert [n for n, _ in scores] == feasible
    for name, score in scores:
        assert 0 <= score <= 10
        assert score == score_node(snap.by_name[name], request)


@PROFILE
@given(request=requests())
def test_request_round_trips_through_json(request: PodRequest) -> None:
    assert PodRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request


@PROFILE
@given(asks=containers())
def test_parse_pod_reads_back_what_a_manifest_says(asks: tuple[ContainerRequest, ...]) -> None:
    def manifest(c: ContainerRequest) -> dict[str, object]:
        limits: dict[str, object] = {"nvidia.com/gpu": str(c.gpus), "nvidia.com/gpucores": c.cores}
        if c.memory_mib is not None:
            limits["nvidia.com/gpumem"] = f"{c.memory_mib}"
        elif c.memory_percent is not None:
            limits["nvidia.com/gpumem-percentage"] = c.memory_percent
        if c.priority is not None:
            limits["nvidia.com/priority"] = c.priority
        extra = {"restartPolicy": "Always"} if c.sidecar else {}
        return k8s_container(c.name, requests=limits, **extra)

    raw = pod_json(
        *(manifest(c) for c in asks if not c.init),
        init=tuple(manifest(c) for c in asks if c.init),
    )
    parsed = parse_pod(raw)
    assert parsed is not None
    assert parsed.containers == asks


@st.composite
def one_slice_requests(draw: st.DrawFn) -> PodRequest:
    """The shapes filter and prioritize memoise or rank per snapshot (one slice of absolute
    memory or of a share of the card's), and, now and then, another shape (which must not
    read a memo or a ranking)."""
    if draw(st.integers(0, 4)) == 0:
        return draw(requests())
    share = draw(st.booleans())
    ask = ContainerRequest(
        "main", 0, False, 1,
        None if share else draw(st.sampled_from(NEEDS)),
        draw(st.sampled_from((10, 25, 50, 100))) if share else None,
        draw(st.sampled_from((0, 0, 10, 30, 50, 100))),
    )  # fmt: skip
    policy = draw(st.sampled_from(("binpack", "spread")))
    return PodRequest("u", "ns", "p", (ask,), node_policy=policy)


@PROFILE
@given(
    cluster=st.tuples(*(nodes(f"n{i}") for i in range(5))),
    asks=st.lists(one_slice_requests(), min_size=1, max_size=4),
    changes=st.lists(
        st.tuples(st.integers(0, 6), st.booleans()).flatmap(
            lambda c: st.tuples(st.just(f"n{c[0]}"), nodes(f"n{c[0]}") if c[1] else st.none())
        ),
        max_size=4,
    ),
)
def test_memoised_answers_follow_the_snapshots_a_cache_derives(
    cluster: tuple[NodeState, ...], asks: list[PodRequest], changes: list[Any]
) -> None:
    """Filter and prioritize on a snapshot derived with `replacing` (the memo carried, only
    the replaced nodes recomputed) answer exactly as on the same nodes built afresh."""
    names = [f"n{i}" for i in range(7)] + ["x"]
    snap = Snapshot.build(cluster)
    for request in asks:  # fill the memos on the first snapshot
        for fit in filter_nodes(snap, request, names)[1]:
            fit.summary()
        prioritize(snap, request, names)
    for name, replacement in changes:  # one change per derived snapshot, as a cache swaps
        snap = snap.replacing({name: replacement})
    fresh = Snapshot.build(snap.nodes)
    for request in asks:
        feasible, failed = filter_nodes(snap, request, names)
        again, failed_again = filter_nodes(fresh, request, names)
        assert feasible == again
        assert filter_nodes(snap, request)[0] == [n.name for n in snap.nodes if n.name in again]
        assert [(f.node, f.summary()) for f in failed] == [
            (f.node, f.summary()) for f in failed_again
        ]
        for name in names:
            known = snap.by_name.get(name)
            assert (name in feasible) == (known is not None and fit_node(known, request).feasible)
        assert prioritize(snap, request, names) == prioritize(fresh, request, names)
        for name, score in prioritize(snap, request, names):
            known = snap.by_name.get(name)
            assert score == (score_node(known, request) if known is not None else 0)


def test_a_ranking_moves_only_the_nodes_a_derived_snapshot_swaps() -> None:
    calls: list[str] = []

    def size(node: NodeState) -> int | None:
        calls.append(node.name)
        return len(node.cards) or None  # a node without cards is left out

    def node(name: str, n: int) -> NodeState:
        return NodeState(name, True, False, tuple(card(f"{name}-{i}", i) for i in range(n)))

    snap = Snapshot.build((node("a", 2), node("b", 1), node("c", 0), node("d", 2)))
    ranking = snap.ranked("k", size)
    assert ranking.pairs == [(1, "b"), (2, "a"), (2, "d")]
    assert ranking.at_least(2) == {"a", "d"} and ranking.at_least(3) == set()
    assert snap.ranked("k", size) is ranking and calls == ["a", "b", "c", "d"]  # built once
    calls.clear()
    derived = snap.replacing({"a": node("a", 1), "d": None, "e": node("e", 3)})
    assert calls == []  # brought up to date when used, not when derived
    moved = derived.ranked("k", size)
    assert moved.pairs == [(1, "a"), (1, "b"), (3, "e")]
    assert sorted(calls) == ["a", "a", "d", "e"]  # the old and new a, the old d, the new e
    assert ranking.pairs == [(1, "b"), (2, "a"), (2, "d")]  # the first snapshot's is its own
    for i in range(RANK_KEYS):
        snap.ranked(i, size)
    calls.clear()
    snap.ranked("k", size)  # pushed out by newer keys: built again
    assert calls == ["a", "b", "c", "d"]


def test_a_node_that_refused_a_shape_is_explained_once_per_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    explained: list[str] = []
    real = fit_module.explain

    def counting(node: NodeState, request: PodRequest) -> tuple[Any, ...]:
        explained.append(node.name)
        return real(node, request)

    monkeypatch.setattr(fit_module, "explain", counting)
    full = card("GPU-f", 0, used_memory_mib=80000, used_slots=1)
    snap = Snapshot.build([build_node("a", full), build_node("b", full), build_node("c")])
    names = ["a", "b", "c"]

    def pod_named(uid: str, mib: int = 4096) -> PodRequest:
        ask = ContainerRequest("main", 0, False, 1, mib, None, 0)
        return PodRequest(uid, "ns", uid, (ask,))

    first = [f.summary() for f in filter_nodes(snap, pod_named("p1"), names)[1]]
    again = [f.summary() for f in filter_nodes(snap, pod_named("p2"), names)[1]]
    assert first == again and len(first) == 2
    assert explained == ["a", "b"]  # the second pod, same shape: no node explained again
    derived = snap.replacing({"a": build_node("a", card("GPU-g", 0, used_memory_mib=79000))})
    [f.summary() for f in filter_nodes(derived, pod_named("p3"), names)[1]]
    assert explained == ["a", "b", "a"]  # only the swapped node
    [f.summary() for f in filter_nodes(derived, pod_named("p4", 2048), names)[1]]
    assert explained == ["a", "b", "a", "b"]  # another shape (a fits it): its own


def test_a_snapshot_remembers_a_few_shapes_and_computes_each_node_once() -> None:
    calls: list[str] = []

    def count(node: NodeState) -> int:
        calls.append(node.name)
        return len(node.cards)

    a, b = NodeState("a", True, False, ()), NodeState("b", True, False, ())
    snap = Snapshot.build((a, b))
    memo = snap.per_node("k", count, -1)
    assert (memo["a"], memo["b"], memo["x"]) == (0, 0, -1)  # x: not in the snapshot
    assert snap.per_node("k", count, -1)["a"] == 0 and calls == ["a", "b"]  # asked once each
    derived = snap.replacing({"b": None, "c": NodeState("c", True, False, ())})
    carried = derived.per_node("k", count, -1)
    assert (carried["a"], carried["b"], carried["c"]) == (0, -1, 0)
    assert calls == ["a", "b", "c"]  # only the added node was worked out for the new snapshot
    assert memo["b"] == 0  # the first snapshot still answers for its own nodes
    later = derived
    for _ in range(STALE_NAMES):  # swaps pile up on a memo nobody reads...
        later = later.replacing({"a": a})
    calls.clear()
    later.per_node("k", count, -1)["c"]
    assert calls == []  # ...up to STALE_NAMES of them, and it is carried
    for _ in range(STALE_NAMES + 1):
        later = later.replacing({"a": a})
    later.per_node("k", count, -1)["c"]
    assert calls == ["c"]  # one more, and it was dropped: worked out again
    calls.clear()
    for i in range(MEMO_KEYS):
        snap.per_node(i, count)
    calls.clear()
    snap.per_node("k", count)["a"]  # pushed out by newer keys: worked out again
    assert calls == ["a"]
