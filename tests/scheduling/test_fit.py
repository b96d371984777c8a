"""Fit, placement, refusals and scores on hand-built nodes."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.scheduling import (
    Assignment,
    NodeFit,
    NodeState,
    PodRequest,
    ReasonCode,
    Refusal,
    Snapshot,
    explain,
    filter_nodes,
    fit_node,
    place_on_node,
    prioritize,
    score_node,
)
from tests.scheduling.builders import A100_MIB, card, container, node, pod


def refused(n: NodeState, request: PodRequest) -> NodeFit:
    """The infeasible fit, after checking fit_node and place_on_node say the same."""
    fit = fit_node(n, request)
    placed = place_on_node(n, request)
    assert not fit.feasible
    assert isinstance(placed, NodeFit)
    assert placed == fit
    assert fit.refusals and all(r.message for r in fit.refusals)
    return fit


def placed(n: NodeState, request: PodRequest) -> tuple[Assignment, ...]:
    """The assignments, after checking fit_node agrees."""
    result = place_on_node(n, request)
    assert not isinstance(result, NodeFit), result
    assert fit_node(n, request).feasible
    return result


def codes(fit: NodeFit) -> list[ReasonCode]:
    return [r.code for r in fit.refusals]


# ------------------------------------------------------------ refusal codes


@pytest.mark.parametrize(
    ("card_kw", "request_kw", "code", "fragments", "permanent"),
    [
        (
            {"healthy": False, "health_reason": "XID 79"},
            {},
            ReasonCode.UNHEALTHY,
            ["GPU-0", "unhealthy", "XID 79"],
            True,
        ),
        ({"cordoned": True}, {}, ReasonCode.CARD_CORDONED, ["GPU-0", "cordoned"], True),
        (
            {},
            {"use_types": ("h100",)},
            ReasonCode.TYPE_EXCLUDED,
            ["GPU-0", "NVIDIA A100-SXM4-80GB", "use-gputype allows only h100"],
            True,
        ),
        (
            {},
            {"nouse_types": ("a100",)},
            ReasonCode.TYPE_EXCLUDED,
            ["nouse-gputype excludes a100"],
            True,
        ),
        (
            {},
            {"use_types": ("a100",), "nouse_types": ("h100", "80gb")},
            ReasonCode.TYPE_EXCLUDED,
            ["nouse-gputype excludes 80gb"],
            True,
        ),
        ({}, {"use_uuids": ("gpu-9",)}, ReasonCode.UUID_EXCLUDED, ["use-gpuuuid"], True),
        ({}, {"nouse_uuids": ("gpu-0",)}, ReasonCode.UUID_EXCLUDED, ["nouse-gpuuuid"], True),
        (
            {"exclusive": True, "used_slots": 1, "used_compute": 100, "used_memory_mib": 10},
            {},
            ReasonCode.EXCLUSIVE_CONFLICT,
            ["held exclusively"],
            False,
        ),
        (
            {"used_slots": 1, "used_memory_mib": 10},
            {"cores": 100},
            ReasonCode.EXCLUSIVE_CONFLICT,
            ["100% compute", "already holds slices"],
            False,
        ),
        ({"slots": 2, "used_slots": 2}, {}, ReasonCode.NO_FREE_SLOT, ["all 2 slice slots"], False),
        ({"slots": 0}, {}, ReasonCode.NO_FREE_SLOT, ["0 slots"], True),
        (
            {"used_memory_mib": A100_MIB - 1024},
            {"memory_mib": 3000},
            ReasonCode.INSUFFICIENT_MEMORY,
            ["GPU-0 (NVIDIA A100-SXM4-80GB)", "needs 3000 MiB, 1024 MiB free"],
            False,
        ),
        (
            {},
            {"memory_mib": A100_MIB + 1},
            ReasonCode.INSUFFICIENT_MEMORY,
            [f"needs {A100_MIB + 1} MiB, the card has {A100_MIB} MiB in total"],
            True,
        ),
        (
            {"used_memory_mib": 1},
            {"memory_mib": None},
            ReasonCode.INSUFFICIENT_MEMORY,
            [f"needs {A100_MIB} MiB, {A100_MIB - 1} MiB free"],
            False,
        ),
        (
            {"used_compute": 80, "used_slots": 1},
            {"cores": 30},
            ReasonCode.INSUFFICIENT_COMPUTE,
            ["needs 30% compute, 20% free"],
            False,
        ),
        (
            {"compute_units": 50},
            {"cores": 60},
            ReasonCode.INSUFFICIENT_COMPUTE,
            ["needs 60% compute, the card has 50 in total"],
            True,
        ),
    ],
)
def test_each_card_refusal_has_its_code_message_and_permanence(
    card_kw: dict[str, Any],
    request_kw: dict[str, Any],
    code: ReasonCode,
    fragments: list[str],
    permanent: bool,
) -> None:
    container_kw = {k: request_kw.pop(k) for k in ("memory_mib", "cores") if k in request_kw}
    n = node("n1", card("GPU-0", 0, **card_kw))
    fit = refused(n, pod(container(**container_kw), **request_kw))
    first = fit.refusals[0]
    assert first.code is code
    assert first.card_uuid == "GPU-0"
    for fragment in fragments:
        assert fragment in first.message
    assert first.permanent is permanent
    assert fit.permanent is permanent
    assert fit.summary() == first.message


def test_refusal_order_follows_the_documented_precedence() -> None:
    # Unhealthy AND cordoned AND excluded: the first check in the order wins.
    n = node("n1", card("GPU-0", 0, healthy=False, cordoned=True))
    fit = refused(n, pod(container(), use_types=("h100",)))
    assert codes(fit) == [ReasonCode.UNHEALTHY]


@pytest.mark.parametrize(
    ("kw", "code", "fragment"),
    [
        ({"use_types": ("h100",)}, ReasonCode.TYPE_EXCLUDED, "use-gputype allows only h100"),
        ({"nouse_types": ("a100",)}, ReasonCode.TYPE_EXCLUDED, "nouse-gputype excludes a100"),
        (
            {"use_types": ("a100",), "nouse_types": ("sxm4", "h100")},
            ReasonCode.TYPE_EXCLUDED,
            "nouse-gputype excludes sxm4",
        ),
        ({"use_uuids": ("gpu-9",)}, ReasonCode.UUID_EXCLUDED, "use-gpuuuid"),
    ],
)
def test_a_node_whose_every_card_is_excluded_gets_one_line(
    kw: dict[str, Any], code: ReasonCode, fragment: str
) -> None:
    fit = refused(node("n1", card("GPU-0", 0), card("GPU-1", 1)), pod(**kw))
    (only,) = fit.refusals
    assert (only.code, only.card_uuid, only.permanent) == (code, None, True)
    assert "node n1: all 2 cards" in only.message
    assert fragment in only.message


def test_uuid_filters_compare_case_insensitively() -> None:
    n = node("n1", card("GPU-AbC", 0), card("GPU-def", 1))
    (a,) = placed(n, pod(use_uuids=("gpu-def",)))
    assert a.card_uuid == "GPU-def"
    (b,) = placed(n, pod(nouse_uuids=("gpu-abc",)))
    assert b.card_uuid == "GPU-def"


def test_type_filter_is_a_substring_of_the_model() -> None:
    n = node("n1", card("GPU-0", 0, model="NVIDIA L4"), card("GPU-1", 1))
    (a,) = placed(n, pod(use_types=("a100",)))
    assert a.card_uuid == "GPU-1"
    (b,) = placed(n, pod(nouse_types=("a100-sxm4",)))
    assert b.card_uuid == "GPU-0"


@pytest.mark.parametrize(
    ("kw", "code"),
    [
        ({"ready": False}, ReasonCode.NODE_NOT_READY),
        ({"cordoned": True}, ReasonCode.NODE_CORDONED),
    ],
)
def test_node_level_refusals(kw: dict[str, Any], code: ReasonCode) -> None:
    n = node("n1", card("GPU-0", 0), **kw)
    fit = refused(n, pod())
    assert codes(fit) == [code]
    assert "n1" in fit.refusals[0].message
    assert fit.permanent


def test_node_not_ready_and_cordoned_reports_both() -> None:
    fit = refused(node("n1", card(), ready=False, cordoned=True), pod())
    assert codes(fit) == [ReasonCode.NODE_NOT_READY, ReasonCode.NODE_CORDONED]


def test_node_without_cards() -> None:
    fit = refused(NodeState("n1", True, False, ()), pod())
    assert codes(fit) == [ReasonCode.NO_CARDS]
    assert fit.permanent


def test_too_few_cards_in_total_is_permanent() -> None:
    n = node("n1", card("GPU-0", 0), card("GPU-1", 1))
    fit = refused(n, pod(container(gpus=3)))
    assert fit.refusals[0].code is ReasonCode.TOO_FEW_CARDS
    assert "needs 3 card(s)" in fit.refusals[0].message
    assert "has 2 that could ever hold one" in fit.refusals[0].message
    assert fit.permanent


def test_too_few_cards_with_room_now_is_temporary() -> None:
    n = node("n1", card("GPU-0", 0), card("GPU-1", 1, used_memory_mib=A100_MIB - 100))
    fit = refused(n, pod(container(gpus=2, memory_mib=1000)))
    assert codes(fit) == [ReasonCode.TOO_FEW_CARDS, ReasonCode.INSUFFICIENT_MEMORY]
    assert "has 1 now" in fit.refusals[0].message
    assert fit.refusals[1].card_uuid == "GPU-1"
    assert not fit.permanent
    assert "(also: 1 insufficient memory)" in fit.summary()


def test_mixed_refusals_put_temporary_ones_first() -> None:
    n = node(
        "n1",
        card("GPU-0", 0, healthy=False),
        card("GPU-1", 1, used_memory_mib=A100_MIB),
    )
    fit = refused(n, pod())
    assert codes(fit) == [ReasonCode.INSUFFICIENT_MEMORY, ReasonCode.UNHEALTHY]
    assert not fit.permanent


def test_refusal_after_the_pods_own_containers_says_so() -> None:
    # One card: the first app container takes most of it, the second cannot follow.
    n = node("n1", card("GPU-0", 0, memory_mib=10000))
    fit = refused(n, pod(container("a", memory_mib=6000), container("b", memory_mib=6000, index=1)))
    assert "container 'b'" in fit.refusals[0].message
    assert "4000 MiB free (after this pod's earlier containers)" in fit.refusals[0].message
    assert not fit.permanent


# --------------------------------------------------------------- card choice


def three_cards() -> NodeState:
    return node(
        "n1",
        card("GPU-0", 0, used_memory_mib=A100_MIB - 10000, used_slots=1),
        card("GPU-1", 1, used_memory_mib=A100_MIB - 30000, used_slots=1),
        card("GPU-2", 2, used_memory_mib=A100_MIB - 20000, used_slots=1),
    )


@pytest.mark.parametrize(("policy", "uuid"), [("binpack", "GPU-0"), ("spread", "GPU-1")])
def test_gpu_policy_picks_least_or_most_free_memory(policy: str, uuid: str) -> None:
    (a,) = placed(three_cards(), pod(container(memory_mib=5000), gpu_policy=policy))
    assert a.card_uuid == uuid
    assert (a.memory_mib, a.cores, a.container_name, a.init) == (5000, 0, "main", False)


def test_binpack_skips_cards_that_are_too_full() -> None:
    (a,) = placed(three_cards(), pod(container(memory_mib=15000), gpu_policy="binpack"))
    assert a.card_uuid == "GPU-2"


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_ties_go_to_the_lower_index(policy: str) -> None:
    # Listed out of index order on purpose.
    n = node("n1", card("GPU-b", 1), card("GPU-a", 0), card("GPU-c", 2))
    (a,) = placed(n, pod(gpu_policy=policy))
    assert a.card_uuid == "GPU-a"


@pytest.mark.parametrize(("policy", "uuid"), [("binpack", "GPU-big"), ("spread", "GPU-small")])
def test_percent_memory_compares_free_memory_after_placement(policy: str, uuid: str) -> None:
    # Both cards have 40960 MiB free; 50% is 40960 MiB on the 80 GiB card (0 left after)
    # but 20480 MiB on the 40 GiB card (20480 left after).
    n = node(
        "n1",
        card("GPU-big", 0, used_memory_mib=40960, used_slots=1),
        card("GPU-small", 1, memory_mib=40960, model="NVIDIA A100-PCIE-40GB"),
    )
    (a,) = placed(n, pod(container(memory_mib=None, memory_percent=50), gpu_policy=policy))
    assert a.card_uuid == uuid
    assert a.memory_mib == (40960 if uuid == "GPU-big" else 20480)


def test_whole_card_needs_an_empty_card() -> None:
    n = node("n1", card("GPU-0", 0, used_memory_mib=1, used_slots=1), card("GPU-1", 1))
    (a,) = placed(n, pod(container(memory_mib=None)))
    assert (a.card_uuid, a.memory_mib) == ("GPU-1", A100_MIB)


def test_multi_gpu_container_uses_distinct_cards() -> None:
    n = node("n1", card("GPU-0", 0), card("GPU-1", 1), card("GPU-2", 2))
    out = placed(n, pod(container(gpus=3, memory_mib=100), gpu_policy="binpack"))
    assert sorted(a.card_uuid for a in out) == ["GPU-0", "GPU-1", "GPU-2"]


def test_containers_may_share_a_card_and_see_each_other() -> None:
    n = node("n1", card("GPU-0", 0, memory_mib=10000), card("GPU-1", 1, memory_mib=4000))
    out = placed(
        n,
        pod(
            container("a", memory_mib=5000),
            container("b", memory_mib=3000, index=1),
            container("c", memory_mib=3000, index=2),
            gpu_policy="spread",
        ),
    )
    # spread: a -> GPU-0 (10000 free), b -> GPU-0 (5000 > 4000), c -> GPU-1 (4000 > 2000)
    assert [(a.container_name, a.card_uuid) for a in out] == [
        ("a", "GPU-0"),
        ("b", "GPU-0"),
        ("c", "GPU-1"),
    ]


def test_exclusive_app_slice_keeps_later_containers_off_its_card() -> None:
    n = node("n1", card("GPU-0", 0), card("GPU-1", 1))
    out = placed(n, pod(container("a", cores=100), container("b", index=1)))
    assert out[0].card_uuid != out[1].card_uuid
    fit = refused(
        node("n1", card("GPU-0", 0)),
        pod(container("a", cores=100), container("b", index=1)),
    )
    assert fit.refusals[0].code is ReasonCode.EXCLUSIVE_CONFLICT


# ---------------------------------------------------------------- init peak


def test_init_and_app_containers_fit_by_peak_not_sum() -> None:
    n = node("n1", card("GPU-0", 0, memory_mib=10000))
    out = placed(
        n,
        pod(
            container("init", init=True, memory_mib=9000, cores=100),
            container("app", memory_mib=9000, cores=100),
        ),
    )
    assert [(a.container_name, a.init, a.card_uuid) for a in out] == [
        ("init", True, "GPU-0"),
        ("app", False, "GPU-0"),
    ]


def test_each_init_container_fits_alone() -> None:
    n = node("n1", card("GPU-0", 0, memory_mib=10000))
    two_inits = pod(
        container("i1", init=True, memory_mib=8000),
        container("i2", init=True, memory_mib=8000, index=1),
        container("app", memory_mib=8000),
    )
    assert len(placed(n, two_inits)) == 3
    too_big = pod(container("i1", init=True, memory_mib=11000), container("app", memory_mib=10))
    fit = refused(n, too_big)
    assert "init container 'i1'" in fit.refusals[0].message


# ------------------------------------------------------------------ scoring


def half_full_node(name: str = "n1") -> NodeState:
    return node(
        name,
        card(f"{name}-0", 0, used_memory_mib=A100_MIB, used_slots=1),
        card(f"{name}-1", 1),
    )


@pytest.mark.parametrize(
    ("mem", "binpack", "spread"),
    [
        (1, 5, 5),  # 0.5 -> 5 (rounded half up)
        (16384, 6, 4),  # (81920 + 16384) / 163840 = 0.6
        (A100_MIB, 10, 0),
    ],
)
def test_score_formula(mem: int, binpack: int, spread: int) -> None:
    n = half_full_node()
    assert score_node(n, pod(container(memory_mib=mem), node_policy="binpack")) == binpack
    assert score_node(n, pod(container(memory_mib=mem), node_policy="spread")) == spread


def test_score_uses_peak_of_init_and_app_and_card_size_for_percent() -> None:
    n = node("n1", card("a", 0), card("b", 1))
    # init peak 2 x 50% of 81920 = 81920 beats app 10% = 8192 -> 81920/163840 = 5
    request = pod(
        container("i", init=True, gpus=2, memory_mib=None, memory_percent=50),
        container("m", memory_mib=None, memory_percent=10),
    )
    assert score_node(n, request) == 5


def test_score_of_node_without_schedulable_cards_is_zero() -> None:
    n = node("n1", card("a", 0, healthy=False))
    assert score_node(n, pod(node_policy="binpack")) == 0
    assert score_node(n, pod(node_policy="spread")) == 0


def test_prioritize_keeps_order_and_scores_unknown_names_zero() -> None:
    snap = Snapshot.build([half_full_node("n1"), node("n2")])
    request = pod(container(memory_mib=16384), node_policy="binpack")
    assert prioritize(snap, request, ["n2", "ghost", "n1"]) == [("n2", 1), ("ghost", 0), ("n1", 6)]
    spread = pod(container(memory_mib=16384), node_policy="spread")
    assert prioritize(snap, spread, ["n1", "n2"]) == [("n1", 4), ("n2", 9)]


# ---------------------------------------------------------------- filtering


def test_filter_splits_names_in_input_order() -> None:
    snap = Snapshot.build(
        [node("n1"), node("n2", ready=False), node("n3"), node("n4", card(memory_mib=100))]
    )
    feasible, failed = filter_nodes(snap, pod(), ["n3", "ghost", "n2", "n1", "n4"])
    assert feasible == ["n3", "n1"]
    assert [f.node for f in failed] == ["ghost", "n2", "n4"]
    assert [f.refusals[0].code for f in failed] == [
        ReasonCode.UNKNOWN_NODE,
        ReasonCode.NODE_NOT_READY,
        ReasonCode.INSUFFICIENT_MEMORY,
    ]
    assert failed[0].permanent
    assert "ghost" in failed[0].summary()


def test_filter_without_names_checks_every_node() -> None:
    snap = Snapshot.build([node("n1"), node("n2", cordoned=True)])
    feasible, failed = filter_nodes(snap, pod())
    assert feasible == ["n1"]
    assert [f.node for f in failed] == ["n2"]


def test_deferred_refusals_equal_eager_ones() -> None:
    n = node("n1", card("GPU-0", 0, used_memory_mib=A100_MIB))
    request = pod()
    _, (deferred,) = filter_nodes(Snapshot.build([n]), request)
    assert deferred == NodeFit("n1", False, explain(n, request))
    assert deferred.refusals is deferred.refusals  # worked out once


def test_snapshot_refuses_duplicate_node_names() -> None:
    with pytest.raises(ValueError, match="twice"):
        Snapshot.build([node("n1"), node("n1")])


def test_nodefit_invariants() -> None:
    r = Refusal(ReasonCode.NO_CARDS, "no cards", None, True)
    with pytest.raises(ValueError):
        NodeFit("n", True, (r,))
    with pytest.raises(ValueError):
        NodeFit("n", False, ())
    ok = NodeFit("n", True)
    assert (ok.refusals, ok.permanent, ok.summary()) == ((), False, "fits")
    assert explain(node("n1"), pod()) == ()


# ------------------------------------------- edges of the filter's fast paths


@pytest.mark.parametrize("cores", [0, 30])
@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_exact_fit_on_memory_and_compute(cores: int, policy: str) -> None:
    n = node("n1", card("GPU-0", 0, used_memory_mib=A100_MIB - 5000, used_compute=70, used_slots=1))
    request = pod(container(memory_mib=5000, cores=cores), gpu_policy=policy)
    placed(n, request)
    two = pod(
        container("a", memory_mib=2000, cores=cores),
        container("b", memory_mib=3000, cores=0, index=1),
        gpu_policy=policy,
    )
    if cores < 30:
        assert len(placed(n, two)) == 2
    else:
        # "a" books the card's last 30%: no slice goes there after it, not even a 0% one.
        assert refused(n, two).refusals[0].code is ReasonCode.INSUFFICIENT_COMPUTE
    refused(n, pod(container(memory_mib=5001, cores=cores), gpu_policy=policy))
    refused(n, pod(container(memory_mib=100, cores=31), gpu_policy=policy))


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_slots_run_out_between_containers(policy: str) -> None:
    # Plenty of memory, but each card has one free slot: two containers need two cards.
    one_slot = {"slots": 2, "used_slots": 1, "used_memory_mib": 10}
    n = node("n1", card("GPU-0", 0, **one_slot))
    request = pod(container("a"), container("b", index=1), gpu_policy=policy)
    fit = refused(n, request)
    assert fit.refusals[0].code is ReasonCode.NO_FREE_SLOT
    n2 = node("n2", card("GPU-0", 0, **one_slot), card("GPU-1", 1, **one_slot))
    out = placed(n2, request)
    assert {a.card_uuid for a in out} == {"GPU-0", "GPU-1"}


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_exactly_enough_cards_for_a_multi_gpu_container(policy: str) -> None:
    n = node("n1", card("GPU-0", 0), card("GPU-1", 1), card("GPU-2", 2, used_memory_mib=A100_MIB))
    request = pod(container("a", gpus=2), container("b", gpus=2, index=1), gpu_policy=policy)
    assert len(placed(n, request)) == 4
    refused(n, pod(container("a", gpus=3), container("b", index=1), gpu_policy=policy))


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_nodes_with_more_cards_than_a_packed_key_holds(policy: str) -> None:
    many = [
        card(f"GPU-{i}", i, used_memory_mib=A100_MIB - 1000 * (i % 7), used_slots=1)
        for i in range(70)
    ]
    n = node("big", *many)
    request = pod(
        container("a", memory_mib=6000, gpus=3),
        container("b", memory_mib=5000, gpus=2, index=1),
        gpu_policy=policy,
    )
    out = placed(n, request)
    # binpack: the tightest cards that fit (6000 free, then the 5000-free ones for b);
    # spread: the roomiest (6000 free) for both, lowest index first.
    a_cards = [x.card_uuid for x in out if x.container_name == "a"]
    assert a_cards == ["GPU-6", "GPU-13", "GPU-20"]
    b_cards = [x.card_uuid for x in out if x.container_name == "b"]
    assert b_cards == (["GPU-5", "GPU-12"] if policy == "binpack" else ["GPU-27", "GPU-34"])
    assert fit_node(n, request).feasible


def test_snapshot_replacing_swaps_adds_and_removes_nodes_in_order() -> None:
    n1, n2, n3 = node("n1"), node("n2"), node("n3")
    snap = Snapshot.build([n1, n2, n3])
    fuller = half_full_node("n2")

    changed = snap.replacing({"n2": fuller, "n4": node("n4"), "n1": None, "ghost": None})

    assert [n.name for n in changed.nodes] == ["n2", "n3", "n4"]  # n2 kept its place
    assert changed.by_name["n2"] is fuller and changed.nodes[0] is fuller
    assert set(changed.by_name) == {"n2", "n3", "n4"}
    assert snap.by_name["n2"] is n2 and len(snap.nodes) == 3  # the original is untouched
    assert changed == Snapshot.build(changed.nodes)  # as if built from scratch
    with pytest.raises(ValueError, match="given as"):
        snap.replacing({"n1": n2})


@pytest.mark.parametrize(
    ("memory_mib", "memory_percent"), [(30000, None), (None, 25)], ids=["MiB", "share"]
)
def test_a_card_with_exactly_the_room_asked_takes_the_slice(
    memory_mib: int | None, memory_percent: int | None
) -> None:
    """The common one-slice shapes are answered from a ranking of the nodes: its bounds are
    inclusive, like the per-card test's."""
    need = memory_mib if memory_mib is not None else A100_MIB * 25 // 100
    exact = card("GPU-e", 0, used_memory_mib=A100_MIB - need, used_compute=70, used_slots=1)
    short_mem = card("GPU-m", 0, used_memory_mib=A100_MIB - need + 1, used_slots=1)
    short_cu = card("GPU-c", 0, used_compute=71, used_slots=1)
    snap = Snapshot.build(
        [node("exact", exact), node("short-mem", short_mem), node("short-cu", short_cu)]
    )
    request = pod(container(memory_mib=memory_mib, memory_percent=memory_percent, cores=30))
    feasible, failed = filter_nodes(snap, request, ["short-mem", "exact", "short-cu"])
    assert feasible == ["exact"]
    assert [f.node for f in failed] == ["short-mem", "short-cu"]
