"""Victim choice against a brute-force search over every subset, on small random nodes."""

from __future__ import annotations

from dataclasses import replace
from itertools import chain, combinations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.scheduling import CardClaim, NodeState, fit_node
from controlplane.scheduling.preempt import Candidate, NoVictims, Victims, choose_victims, rank
from tests.scheduling.builders import card, container, pod

MEMORY = (1000, 4000, 10000, 20000, 40000)


def _node_holding(cards: tuple, pods: list[Candidate]) -> NodeState:
    """The node as the ledger would sum it with exactly `pods` on it (built from scratch)."""
    built = []
    for c in cards:
        claims = [p.claims[c.uuid] for p in pods if c.uuid in p.claims]
        built.append(
            replace(
                c,
                used_memory_mib=sum(x.memory_mib for x in claims),
                used_compute=sum(x.cores for x in claims),
                used_slots=sum(x.slots for x in claims),
                exclusive=any(x.exclusive for x in claims),
            )
        )
    return NodeState("n0", True, False, tuple(built))


@st.composite
def scenes(draw: st.DrawFn) -> tuple:
    count = draw(st.integers(1, 3))
    cards = tuple(
        card(f"GPU-{i}", i, memory_mib=40960, slots=draw(st.integers(1, 4))) for i in range(count)
    )
    pods = []
    for i in range(draw(st.integers(0, 6))):
        held = draw(st.lists(st.sampled_from(cards), min_size=1, max_size=2, unique=True))
        cores = draw(st.sampled_from((0, 10, 30, 50, 100)))
        memory = draw(st.sampled_from(MEMORY))
        claims = {c.uuid: CardClaim(memory, cores, 1, cores >= 100) for c in held}
        pods.append(
            Candidate(
                uid=f"uid-{i}",
                namespace="ml",
                name=f"p{i}",
                priority=draw(st.integers(0, 3)),
                started=float(draw(st.integers(0, 5))),
                claims=claims,
                budget=draw(st.sampled_from((None, None, "ml/pdb"))),
            )
        )
    ask = pod(
        container(
            gpus=draw(st.integers(1, count)),
            memory_mib=draw(st.sampled_from(MEMORY)),
            cores=draw(st.sampled_from((0, 20, 50, 100))),
        )
    )
    priority = draw(st.integers(1, 4))
    budgets = {"ml/pdb": draw(st.integers(0, 2))}
    return cards, pods, ask, priority, budgets


def _brute_force(cards: tuple, pods: list[Candidate], ask, priority: int, budgets: dict):
    lower = [p for p in pods if p.priority < priority]
    best = None
    subsets = chain.from_iterable(combinations(lower, k) for k in range(len(lower) + 1))
    for chosen in subsets:
        per_budget = {}
        for p in chosen:
            if p.budget:
                per_budget[p.budget] = per_budget.get(p.budget, 0) + 1
        if any(n > budgets.get(b, 0) for b, n in per_budget.items()):
            continue
        left = [p for p in pods if p not in chosen]
        if fit_node(_node_holding(cards, left), ask).feasible and (
            best is None or rank(chosen) < rank(best)
        ):
            best = chosen
    return best


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenes())
def test_the_chosen_victims_are_the_best_set_a_full_search_finds(scene: tuple) -> None:
    cards, pods, ask, priority, budgets = scene
    node = _node_holding(cards, pods)
    got = choose_victims(node, ask, pods, priority=priority, budgets=budgets)
    best = _brute_force(cards, pods, ask, priority, budgets)
    if best is None:
        assert isinstance(got, NoVictims), got
        return
    assert isinstance(got, Victims), (got, best)
    assert got.exact
    assert got.rank == rank(best)
    assert all(p.priority < priority for p in got.pods)
    left = [p for p in pods if p not in got.pods]
    assert fit_node(_node_holding(cards, left), ask).feasible


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenes())
def test_the_fallback_evicts_no_pod_it_could_spare(scene: tuple) -> None:
    cards, pods, ask, priority, budgets = scene
    node = _node_holding(cards, pods)
    got = choose_victims(node, ask, pods, priority=priority, budgets=budgets, max_checks=0)
    if not isinstance(got, Victims):
        return  # the fallback may miss a set the budgets allow; it never breaks one
    assert all(p.priority < priority for p in got.pods)
    left = [p for p in pods if p not in got.pods]
    assert fit_node(_node_holding(cards, left), ask).feasible
    for spared in got.pods:
        assert not fit_node(_node_holding(cards, [*left, spared]), ask).feasible, spared


def _pod(i: int, memory: int, priority: int, started: float = 0.0, **kw) -> Candidate:
    return Candidate(
        f"uid-{i}",
        "ml",
        f"p{i}",
        priority,
        started,
        {"GPU-0": CardClaim(memory, 0, 1, False)},
        **kw,
    )


def test_fewest_pods_then_lowest_priority_then_newest() -> None:
    cards = (card("GPU-0", 0, memory_mib=81920, slots=8),)
    big = _pod(0, 30000, priority=2)
    small = [_pod(i, 10000, priority=0, started=float(i)) for i in (1, 2, 3)]
    pods = [big, *small]
    node = _node_holding(cards, pods)  # 60000 held, 21920 free
    # 40000 needs 18080 more: the big pod alone beats two small ones of lower priority.
    got = choose_victims(node, pod(container(memory_mib=40000)), pods, priority=5)
    assert isinstance(got, Victims) and [p.name for p in got.pods] == ["p0"]
    # 30000 needs 8080 more: one pod either way, so the lower priority, and of those the newest.
    got = choose_victims(node, pod(container(memory_mib=30000)), pods, priority=5)
    assert isinstance(got, Victims) and [p.name for p in got.pods] == ["p3"]
    # Nothing needed: no victims.
    got = choose_victims(node, pod(container(memory_mib=20000)), pods, priority=5)
    assert isinstance(got, Victims) and got.pods == ()
    # Two needed among equals: the two newest.
    cards = (card("GPU-0", 0, memory_mib=40960, slots=8),)
    got = choose_victims(
        _node_holding(cards, small), pod(container(memory_mib=30000)), small, priority=5
    )
    assert isinstance(got, Victims)
    assert sorted(p.name for p in got.pods) == ["p2", "p3"]


def test_equal_or_higher_priority_pods_are_never_victims() -> None:
    cards = (card("GPU-0", 0, memory_mib=40960, slots=8),)
    pods = [_pod(0, 40000, priority=5)]
    got = choose_victims(
        _node_holding(cards, pods), pod(container(memory_mib=1000)), pods, priority=5
    )
    assert isinstance(got, NoVictims) and "lower priority" in got.reason


def test_a_budget_that_allows_nothing_is_named() -> None:
    cards = (card("GPU-0", 0, memory_mib=40960, slots=8),)
    pods = [_pod(0, 40000, priority=0, budget="ml/keep")]
    got = choose_victims(
        _node_holding(cards, pods), pod(container(memory_mib=1000)), pods, priority=5, budgets={}
    )
    assert isinstance(got, NoVictims)
    assert got.blocked_by_budget == ("ml/keep",) and "PodDisruptionBudget" in got.reason
    got = choose_victims(
        _node_holding(cards, pods),
        pod(container(memory_mib=1000)),
        pods,
        priority=5,
        budgets={"ml/keep": 1},
    )
    assert isinstance(got, Victims) and [p.name for p in got.pods] == ["p0"]


@pytest.mark.parametrize("exclusive_stays", [True, False])
def test_an_exclusive_pod_that_stays_keeps_the_card_closed(exclusive_stays: bool) -> None:
    cards = (card("GPU-0", 0, memory_mib=40960, slots=8),)
    whole = Candidate(
        "uid-w", "ml", "whole", 0 if not exclusive_stays else 9, 0.0,
        {"GPU-0": CardClaim(1000, 100, 1, True)},
    )  # fmt: skip
    other = _pod(1, 1000, priority=0)
    pods = [whole, other]
    got = choose_victims(
        _node_holding(cards, pods), pod(container(memory_mib=1000)), pods, priority=5
    )
    if exclusive_stays:
        assert isinstance(got, NoVictims)
    else:
        assert isinstance(got, Victims) and [p.name for p in got.pods] == ["whole"]


def test_victims_on_a_mig_card_free_their_placements() -> None:
    # A full A100-80GB in MIG mode: seven 1g.10gb instances of low-priority pods.
    mig = card(
        "GPU-0", 0, mode="mig", mig_enabled=True, memory_mib=81920, slots=7
    )  # fmt: skip
    pods = [
        Candidate(
            f"uid-{i}",
            "ml",
            f"p{i}",
            0,
            float(i),
            {"GPU-0": CardClaim(9856, 14, 1, False, 1 << i)},
        )
        for i in range(7)
    ]
    node = _node_holding((mig,), pods)
    node = NodeState(
        node.name, True, False, (replace(node.cards[0], mig_used=(1 << 7) - 1),)
    )  # fmt: skip
    ask = pod(container(memory_mib=30000), vgpu_modes=("mig",))  # a 3g.40gb
    got = choose_victims(node, ask, pods, priority=5)
    assert isinstance(got, Victims)
    # A 3g.40gb takes four memory slices at start 0 or 4: the four newest free slices 4..7 hold
    # only three instances (4, 5, 6), and the newest pods win ties.
    assert sorted(p.name for p in got.pods) == ["p4", "p5", "p6"]
