"""Virtual device memory in the scheduling core (docs/virtual-memory.md): the opt-in, the factor,
the three budgets in the greedy, the filter's shortcuts and the explanations, and property tests
of any sequence of binds, releases and factor changes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.scheduling import (
    Assignment,
    CardState,
    NodeState,
    PodRequest,
    RequestError,
    Snapshot,
    claims_per_card,
    factor_refusal,
    filter_nodes,
    fit_node,
    format_factor,
    parse_factor,
    parse_pod,
    place_on_node,
    resident_mib,
)
from controlplane.scheduling.memory import FactorError, min_factor, virtual_mib
from controlplane.scheduling.preempt import Candidate, Victims, choose_victims
from tests.pods import gpu_container, pod_json
from tests.scheduling.builders import card
from tests.scheduling.test_properties import check_against_reference, fast_requests, tight_nodes

OPT_IN = "tessera.io/memory-oversubscription"
L4 = 24576


def pod(
    name: str,
    *containers: dict[str, Any],
    opted: bool | None = None,
    annotations: dict[str, str] | None = None,
) -> PodRequest:
    ann = dict(annotations or {})
    if opted is not None:
        ann[OPT_IN] = "true" if opted else "false"
    body = pod_json(name, containers=list(containers) or [gpu_container("main", mem=1000)])
    body["metadata"]["annotations"] = ann
    request = parse_pod(body)
    assert request is not None
    return request


def percent(name: str, pct: int, gpus: int = 1, cores: int = 0) -> dict[str, Any]:
    container = gpu_container(name, gpus=gpus, cores=cores)
    container["resources"]["limits"]["nvidia.com/gpumem-percentage"] = pct
    return container


def one_card_node(factor: int = 200, reserve: int = 100_000, memory: int = 1000) -> NodeState:
    return NodeState(
        "n1", True, False, (card("GPU-1", 0, memory_mib=memory, factor=factor),), reserve
    )


def bound(node: NodeState, request: PodRequest) -> NodeState:
    placed = place_on_node(node, request)
    assert isinstance(placed, tuple), placed
    return node.with_claims(claims_per_card(a.to_claim() for a in placed))


# --- the factor and the opt-in ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "hundredths"),
    [("1", 100), ("1.5", 150), ("1.50", 150), ("2.25", 225), ("16", 1600), ("16.00", 1600)],
)
def test_a_factor_is_read_in_hundredths_and_written_back(text: str, hundredths: int) -> None:
    assert parse_factor(text) == hundredths
    assert parse_factor(format_factor(hundredths)) == hundredths


@pytest.mark.parametrize(
    "text", ["0.5", "0", "16.01", "17", "1.555", "abc", "", " 1.5", "1.", ".5", "-2", "01", 2, None]
)
def test_a_factor_below_1_above_16_or_with_three_decimals_is_refused(text: Any) -> None:
    with pytest.raises(FactorError, match='from "1" to "16"'):
        parse_factor(text)


def test_the_resident_part_is_the_memory_over_f_rounded_up() -> None:
    assert resident_mib(1000, 100) == 1000
    assert resident_mib(1000, 200) == 500
    assert resident_mib(1001, 200) == 501
    assert resident_mib(1000, 150) == 667  # 666.67 rounded up
    assert virtual_mib(1000, 150) == 1500


@pytest.mark.parametrize(("value", "opted"), [("true", True), ("false", False), ("TRUE", True)])
def test_the_opt_in_annotation_is_true_or_false(value: str, opted: bool) -> None:
    request = pod("p", annotations={OPT_IN: value})
    assert request.memory_oversubscription is opted
    assert PodRequest.from_dict(request.to_dict()).memory_oversubscription is opted


def test_any_other_opt_in_value_is_refused_naming_the_annotation() -> None:
    with pytest.raises(RequestError) as caught:
        pod("p", annotations={OPT_IN: "yes"})
    assert caught.value.field == f"metadata.annotations.{OPT_IN}"
    assert '"true" or "false"' in str(caught.value)


def test_a_pod_without_the_opt_in_stores_the_request_it_stored_before() -> None:
    assert "memory_oversubscription" not in pod("p").to_dict()
    assert pod("p", opted=True).shape != pod("p").shape  # the filter's memos keep them apart


# --- the three budgets ------------------------------------------------------------------------


def test_three_opted_in_pods_of_60_percent_share_one_card_at_factor_2() -> None:
    node = one_card_node(factor=200, reserve=2000)
    for i in range(3):
        request = pod(f"p{i}", percent("main", 60), opted=True)
        assert fit_node(node, request).feasible
        placed = place_on_node(node, request)
        assert isinstance(placed, tuple)
        assert placed[0].memory_mib == 600 and placed[0].resident_mib == 300
        node = bound(node, request)
    only = node.cards[0]
    assert (only.used_memory_mib, only.resident_used, node.used_spill_mib) == (1800, 900, 900)


def test_a_pod_without_the_opt_in_is_refused_by_the_resident_budget() -> None:
    node = one_card_node(factor=200, reserve=2000)
    for i in range(3):
        node = bound(node, pod(f"p{i}", percent("main", 60), opted=True))
    plain = pod("plain", percent("main", 50))
    fit = fit_node(node, plain)
    assert not fit.feasible
    assert "500 MiB of resident memory" in fit.summary()
    assert "100 MiB free" in fit.summary()
    assert not fit.permanent  # the opted-in pods ending makes room
    feasible, failed = filter_nodes(Snapshot.build([node]), plain)
    assert feasible == [] and failed[0].summary() == fit.summary()


def test_the_virtual_budget_refuses_past_f_times_the_card() -> None:
    # Bound at factor 4 (1000 MiB, 250 resident), then the factor lowered to 2: the resident
    # budget has room for 1100 MiB / 2, the virtual budget has 1000 MiB left.
    node = bound(one_card_node(factor=400), pod("a", percent("main", 100), opted=True))
    lowered = NodeState("n1", True, False, (replace(node.cards[0], factor=200),), 100_000,
                        node.used_spill_mib)  # fmt: skip
    fit = fit_node(lowered, pod("b", gpu_container("main", mem=1100), opted=True))
    assert not fit.feasible
    assert "1100 MiB of virtual memory, 1000 MiB free of 2000 MiB" in fit.summary()
    assert fit_node(lowered, pod("c", gpu_container("main", mem=1000), opted=True)).feasible


def test_the_host_spill_reserve_bounds_what_a_node_spills() -> None:
    node = one_card_node(factor=200, reserve=400)
    node = bound(node, pod("a", percent("main", 60), opted=True))  # spills 300
    fit = fit_node(node, pod("b", percent("main", 60), opted=True))
    assert not fit.feasible
    assert "host spill reserve of node n1 has 100 MiB free of 400 MiB" in fit.summary()
    # No reserve at all (the default): an opted-in pod is never taken past its resident part.
    bare = one_card_node(factor=200, reserve=0)
    refused = fit_node(bare, pod("c", percent("main", 60), opted=True))
    assert not refused.feasible and refused.permanent


def test_an_opted_in_pod_on_a_card_of_factor_1_is_resident_in_full() -> None:
    node = one_card_node(factor=100)
    placed = place_on_node(node, pod("a", percent("main", 60), opted=True))
    assert isinstance(placed, tuple) and placed[0].resident_mib is None
    assert not fit_node(bound(node, pod("a", percent("main", 60), opted=True)),
                        pod("b", percent("main", 60), opted=True)).feasible  # fmt: skip


def test_lowering_a_factor_below_what_is_bound_is_refused_with_the_figures() -> None:
    assert factor_refusal(1000, 1800, 200) is None
    why = factor_refusal(1000, 1800, 150)
    assert why is not None and "1800 MiB" in why and "1500 MiB" in why and "1.8" in why
    assert min_factor(1000, 1800) == 180


def test_an_init_container_of_an_opted_in_pod_is_resident_in_full() -> None:
    init = percent("warm", 60)
    body_pod = pod("p", percent("main", 60), opted=True)
    body = pod_json("p2", containers=[percent("main", 60)])
    body["spec"]["initContainers"] = [init]
    body["metadata"]["annotations"] = {OPT_IN: "true"}
    request = parse_pod(body)
    assert request is not None
    placed = place_on_node(one_card_node(factor=200, reserve=2000), request)
    assert isinstance(placed, tuple)
    by_name = {a.container_name: a for a in placed}
    assert by_name["warm"].resident_mib is None and by_name["main"].resident_mib == 300
    assert body_pod.plan.oversub


# --- property tests -----------------------------------------------------------------------------

FACTORS = st.sampled_from([100, 125, 150, 200, 300, 1600])


@st.composite
def containers(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for i in range(draw(st.integers(1, 2))):
        gpus = draw(st.integers(1, 2))
        if draw(st.booleans()):
            c = gpu_container(f"c{i}", mem=draw(st.integers(1, 1800)), gpus=gpus)
        else:
            c = percent(f"c{i}", draw(st.integers(1, 100)), gpus=gpus)
        c["resources"]["limits"]["nvidia.com/gpucores"] = draw(st.sampled_from([0, 0, 10, 30]))
        out.append(c)
    return out


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, Any]]:
    ops: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["bind", "bind", "bind", "release", "factor"]))
        if kind == "bind":
            policy = draw(st.sampled_from(["binpack", "spread"]))
            ops.append((kind, (draw(containers()), draw(st.booleans()), policy)))
        elif kind == "release":
            ops.append((kind, draw(st.integers(0, 20))))
        else:
            ops.append((kind, (draw(st.integers(0, 2)), draw(FACTORS))))
    return ops


def _state(
    memories: list[int], factors: list[int], reserve: int, pods: dict[str, tuple[Assignment, ...]]
) -> NodeState:
    """The node as the ledger would read it: every bound pod's claims summed per card."""
    used = {f"GPU-{i}": [0, 0] for i in range(len(memories))}
    spill = 0
    for placed in pods.values():
        for uuid, claim in claims_per_card(a.to_claim() for a in placed).items():
            used[uuid][0] += claim.memory_mib
            used[uuid][1] += claim.resident
            spill += claim.spill_mib
    cards = tuple(
        CardState(f"GPU-{i}", i, "L4", m, 100, 4, 0, True, "", False,
                  used_memory_mib=used[f"GPU-{i}"][0],
                  used_compute=sum(a.cores for p in pods.values() for a in p
                                   if a.card_uuid == f"GPU-{i}" and not a.init),
                  used_slots=sum(1 for p in pods.values() for a in p
                                 if a.card_uuid == f"GPU-{i}" and not a.init),
                  factor=factors[i], used_resident_mib=used[f"GPU-{i}"][1])
        for i, m in enumerate(memories)
    )  # fmt: skip
    return NodeState("n", True, False, cards, reserve, spill)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    memories=st.lists(st.sampled_from([1000, 1500, 2000]), min_size=1, max_size=3),
    initial=st.lists(FACTORS, min_size=3, max_size=3),
    reserve=st.sampled_from([0, 500, 3000]),
    ops=operations(),
)
def test_no_sequence_of_binds_releases_and_factor_changes_breaks_a_budget(
    memories: list[int], initial: list[int], reserve: int, ops: list[tuple[str, Any]]
) -> None:
    factors = initial[: len(memories)]
    pods: dict[str, tuple[Assignment, ...]] = {}
    opted: dict[str, bool] = {}
    factor_at_bind: dict[str, list[int]] = {}  # a bound slice keeps the part it was given
    for n, (kind, arg) in enumerate(ops):
        node = _state(memories, factors, reserve, pods)
        if kind == "bind":
            spec, opt, policy = arg
            request = pod(f"p{n}", *spec, opted=opt,
                          annotations={"tessera.io/gpu-policy": policy})  # fmt: skip
            placed = place_on_node(node, request)
            fit = fit_node(node, request)
            feasible, _ = filter_nodes(Snapshot.build([node]), request)
            # The filter's shortcuts answer exactly as the greedy.
            assert fit.feasible == isinstance(placed, tuple) == (feasible == ["n"])
            if isinstance(placed, tuple):
                pods[request.name] = placed
                opted[request.name] = opt
                factor_at_bind[request.name] = list(factors)
            else:
                assert placed.refusals  # a why for every refusal
        elif kind == "release" and pods:
            pods.pop(sorted(pods)[arg % len(pods)])
        elif kind == "factor" and arg[0] < len(memories):
            i, factor = arg
            c = node.cards[i]
            if factor_refusal(c.memory_mib, c.used_memory_mib, factor) is None:
                factors[i] = factor
        node = _state(memories, factors, reserve, pods)
        for c in node.cards:
            assert c.resident_used <= c.memory_mib
            assert c.used_memory_mib <= virtual_mib(c.memory_mib, c.factor)
        assert node.used_spill_mib <= reserve
        for name, placed in pods.items():
            for a in placed:
                may_spill = opted[name] and not (a.init and not a.sidecar)
                factor = factor_at_bind[name][int(a.card_uuid.removeprefix("GPU-"))]
                # Resident in full (None), or exactly memory / f rounded up, and below memory.
                assert a.resident_mib in (None, resident_mib(a.memory_mib, factor)), a
                assert a.resident_mib is None or (may_spill and a.resident_mib < a.memory_mib), a


@settings(max_examples=200, deadline=None)
@given(
    memories=st.lists(st.sampled_from([1000, 2000]), min_size=1, max_size=3),
    spec=containers(),
    used=st.lists(st.integers(0, 900), min_size=3, max_size=3),
)
def test_with_every_factor_1_an_opted_in_pod_is_placed_as_one_without(
    memories: list[int], spec: list[dict[str, Any]], used: list[int]
) -> None:
    cards = tuple(
        CardState(f"GPU-{i}", i, "L4", m, 100, 4, 0, True, "", False, used_memory_mib=used[i])
        for i, m in enumerate(memories)
    )
    node = NodeState("n", True, False, cards, 10_000)
    plain = place_on_node(node, pod("a", *spec))
    opted = place_on_node(node, pod("a", *spec, opted=True))
    assert isinstance(plain, tuple) == isinstance(opted, tuple)
    if isinstance(plain, tuple):
        assert plain == opted


# --- the filter's shortcuts on oversubscribed nodes ----------------------------------------------


@st.composite
def oversubscribed(draw: st.DrawFn) -> NodeState:
    """A tight node of test_properties whose cards carry factors, slices past their memory and
    resident sums below their memory sums, and a host spill reserve."""
    node = draw(tight_nodes())
    cards = []
    for c in node.cards:
        factor = draw(FACTORS)
        virtual = virtual_mib(c.memory_mib, factor)
        used = draw(st.sampled_from((c.used_memory_mib, c.used_memory_mib, virtual,
                                     (c.memory_mib + virtual) // 2)))  # fmt: skip
        # Bound at any factor up to 16 and lowered since: the resident sum may be as low as
        # used / 16, and then the virtual budget is the smaller one.
        least = resident_mib(used, 1600)
        resident = draw(st.integers(least, max(least, min(used, c.memory_mib))))
        cards.append(replace(c, factor=factor, used_memory_mib=used, used_resident_mib=resident))
    reserve = draw(st.sampled_from((0, 2000, 10000, 50000)))
    return NodeState(node.name, True, False, tuple(cards), reserve, draw(st.integers(0, reserve)))


def as_plain(node: NodeState) -> NodeState:
    """The same node with factor 1 everywhere and each card's free memory what a slice without
    the opt-in may take on the original."""
    cards = tuple(
        replace(
            c, factor=100, used_resident_mib=None, used_memory_mib=c.memory_mib - c.free_memory_mib
        )
        for c in node.cards
    )
    return NodeState(node.name, True, False, cards)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(node=oversubscribed(), request=fast_requests(), opted=st.booleans())
def test_every_shortcut_answers_as_the_greedy_on_oversubscribed_nodes(
    node: NodeState, request: PodRequest, opted: bool
) -> None:
    if opted:
        request = replace(request, memory_oversubscription=True)
    fit = fit_node(node, request)
    placed = place_on_node(node, request)
    feasible, _ = filter_nodes(Snapshot.build([node]), request)
    assert fit.feasible == isinstance(placed, tuple) == (feasible == [node.name])
    if not fit.feasible:
        assert fit.refusals and all(r.message for r in fit.refusals)
    if not opted:
        # A pod without the opt-in sees each card's smaller budget as its free memory, exactly:
        # the same cards as on a plain node with that much free, and as the reference model.
        plain = place_on_node(as_plain(node), request)
        assert isinstance(plain, tuple) == isinstance(placed, tuple)
        if isinstance(placed, tuple):
            assert placed == plain
        check_against_reference(as_plain(node), request)


# --- preemption ------------------------------------------------------------------------------


def test_preemption_frees_the_budget_that_refused() -> None:
    """Three opted-in pods fill the card's resident budget and the node's spill reserve; a
    higher-priority pod asking 60 % needs one of them gone, whichever budget it meets."""
    node = one_card_node(factor=200, reserve=900)
    held = []
    for i in range(3):
        request = pod(f"p{i}", percent("main", 60), opted=True)
        placed = place_on_node(node, request)
        assert isinstance(placed, tuple)
        claims = claims_per_card(a.to_claim() for a in placed)
        held.append(Candidate(f"uid-{i}", "ml", f"p{i}", 0, float(i), claims))
        node = node.with_claims(claims)
    for opted in (True, False):
        urgent = pod("urgent", percent("main", 60 if opted else 20), opted=opted)
        assert not fit_node(node, urgent).feasible
        victims = choose_victims(node, urgent, held, priority=10)
        assert isinstance(victims, Victims) and len(victims.pods) == 1
        freed = node.without_claims([victims.pods[0].claims], frozenset())
        assert freed.used_spill_mib == 600 and freed.cards[0].resident_used == 600
        assert fit_node(freed, urgent).feasible
