"""The placement rules HAMi adds to plain binpack/spread, on hand-built nodes: a card whose
compute is fully booked, the mutex, numa and topology-aware GPU policies, numa-bind,
vgpu-mode, whole cards from gpumem-percentage 0, and sidecar init containers."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.scheduling import (
    CardState,
    NodeState,
    ReasonCode,
    Snapshot,
    claims_per_card,
    filter_nodes,
    parse_pod,
    place_on_node,
    prioritize,
    score_node,
)
from tests.pods import container as k8s_container
from tests.scheduling.builders import card, container, node, pod, pod_json
from tests.scheduling.test_fit import placed, refused

L4_MIB = 24576


def cards_of(assignments: Any) -> list[str]:
    return [a.card_uuid for a in assignments]


# ----------------------------------------------- a card whose compute is all booked


def full_compute(uuid: str = "GPU-full", index: int = 0, **kw: Any) -> CardState:
    """A card whose compute others booked (60% + 40%), most of its memory free."""
    return card(uuid, index, used_memory_mib=40000, used_compute=100, used_slots=2, **kw)


def test_a_zero_percent_slice_is_kept_off_a_card_with_no_compute_left() -> None:
    # HAMi (device.go, "You can't allocate core=0 job to an already full GPU"): the third pod
    # of the corpus' c01 case does not go to the H200 whose cores two pods booked.
    n = node("h200", full_compute())
    fit = refused(n, pod(container(memory_mib=3000, cores=0)))
    [reason] = fit.refusals
    assert reason.code is ReasonCode.INSUFFICIENT_COMPUTE
    assert "all of its compute is booked" in reason.message and "gpucores 0" in reason.message
    assert not reason.permanent  # the pods holding the compute may end


def test_one_percent_left_is_enough_for_a_zero_percent_slice() -> None:
    n = node("n", card("GPU-0", 0, used_memory_mib=40000, used_compute=99, used_slots=2))
    placed(n, pod(container(memory_mib=3000, cores=0)))


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_card_choice_skips_the_spent_card(policy: str) -> None:
    # Binpack would pick the fuller card; the spent one must not even be a candidate.
    n = node("n", full_compute("GPU-full", 0), card("GPU-free", 1, used_memory_mib=1000))
    assert cards_of(placed(n, pod(container(memory_mib=3000), gpu_policy=policy))) == ["GPU-free"]


def test_the_pods_own_containers_can_spend_a_card() -> None:
    # The first container books the last 40%; the second (0%) must go elsewhere.
    busy = card("GPU-0", 0, used_memory_mib=1000, used_compute=60, used_slots=1)
    request = pod(
        container("a", memory_mib=1000, cores=40),
        container("b", memory_mib=1000, cores=0, index=1),
        container("c", memory_mib=1000, cores=0, index=2),
        gpu_policy="binpack",
    )
    fit = refused(node("n", busy), request)
    assert "after this pod's earlier containers" in fit.refusals[0].message
    out = placed(node("n", busy, card("GPU-1", 1)), request)
    assert cards_of(out) == ["GPU-0", "GPU-1", "GPU-1"]


def test_filter_prioritize_and_explain_agree_on_the_corpus_c01_nodes() -> None:
    snap = Snapshot.build(
        [
            node("a100"),
            node("h200", full_compute("GPU-h200", 0, model="NVIDIA H200", memory_mib=143771)),
        ]
    )
    request = pod(container(memory_mib=3000, cores=0))
    for _ in range(2):  # the second answer comes from the snapshot's memo
        feasible, failed = filter_nodes(snap, request, ["a100", "h200"])
        assert feasible == ["a100"]
        assert [f.node for f in failed] == ["h200"]
        assert failed[0].refusals[0].code is ReasonCode.INSUFFICIENT_COMPUTE
    assert prioritize(snap, request, feasible) == [
        ("a100", score_node(snap.by_name["a100"], request))
    ]
    # A slice that asks for compute was refused there already, for the same reason in numbers.
    failed = filter_nodes(snap, pod(container(memory_mib=3000, cores=10)), ["h200"])[1]
    assert "needs 10% compute, 0% free" in failed[0].refusals[0].message


# ------------------------------------------------------------------------- mutex


def test_mutex_keeps_the_pod_off_cards_that_hold_any_slice() -> None:
    # Corpus w09: gpu-pod holds the H200's only card; gpu-pod-mutex may not share it.
    busy = card("GPU-h200", 0, used_memory_mib=3000, used_compute=30, used_slots=1)
    request = pod(container(memory_mib=3000, cores=30), gpu_policy="mutex,spread")
    [reason] = refused(node("h200", busy), request).refusals
    assert reason.code is ReasonCode.EXCLUSIVE_CONFLICT and not reason.permanent
    assert "mutex" in reason.message
    out = placed(node("a100", busy, card("GPU-idle", 1)), request)
    assert cards_of(out) == ["GPU-idle"]
    # Without mutex the same pod shares the busy card under binpack.
    assert cards_of(placed(node("a100", busy, card("GPU-idle", 1)), pod(
        container(memory_mib=3000, cores=30), gpu_policy="binpack"
    ))) == ["GPU-h200"]  # fmt: skip


def test_mutex_app_containers_do_not_share_a_card_but_init_containers_may() -> None:
    request = pod(
        container("w", init=True, memory_mib=1000),
        container("a", memory_mib=1000),
        container("b", memory_mib=1000, index=1),
        gpu_policy="mutex,binpack",
    )
    refused(node("one", card("GPU-0", 0)), request)
    out = placed(node("two", card("GPU-0", 0), card("GPU-1", 1)), request)
    by = {a.container_name: a.card_uuid for a in out}
    assert by["a"] != by["b"] and by["w"] in {by["a"], by["b"]}
    # HAMi's mutex counts the pod's own earlier containers too (Used > 0 after them).
    assert claims_per_card(a.to_claim() for a in out)[by["a"]].slots == 1


# ------------------------------------------------------------------- numa order


def numa_node() -> NodeState:
    """Four cards: NUMA 0 holds the fullest and an emptier card, NUMA 1 the middle ones."""
    return node(
        "n",
        card("GPU-0", 0, numa_node=0, used_memory_mib=70000, used_slots=1),
        card("GPU-1", 1, numa_node=0),
        card("GPU-2", 2, numa_node=1, used_memory_mib=60000, used_slots=1),
        card("GPU-3", 3, numa_node=1, used_memory_mib=10000, used_slots=1),
    )


@pytest.mark.parametrize(
    ("policy", "gpus", "expected"),
    [
        ("binpack", 1, ["GPU-0"]),
        ("binpack,numa", 1, ["GPU-0"]),  # room first, NUMA breaks ties
        ("numa,binpack", 1, ["GPU-0"]),
        ("binpack", 2, ["GPU-0", "GPU-2"]),
        ("numa,binpack", 2, ["GPU-0", "GPU-1"]),  # NUMA node first, then room
        ("spread", 2, ["GPU-1", "GPU-3"]),
        ("numa,spread", 2, ["GPU-1", "GPU-0"]),
        ("numa,spread,mutex", 2, ["GPU-1"]),  # the only idle card: too few
    ],
)
def test_numa_in_the_chain_orders_cards_by_numa_node(
    policy: str, gpus: int, expected: list[str]
) -> None:
    request = pod(container(memory_mib=1000, gpus=gpus), gpu_policy=policy)
    if len(expected) < gpus:
        refused(numa_node(), request)
        return
    assert cards_of(placed(numa_node(), request)) == expected


def test_numa_tiebreak_between_equal_cards() -> None:
    n = node("n", card("GPU-0", 0, numa_node=1), card("GPU-1", 1, numa_node=0))
    assert cards_of(placed(n, pod(container(), gpu_policy="spread"))) == ["GPU-0"]
    assert cards_of(placed(n, pod(container(), gpu_policy="spread,numa"))) == ["GPU-1"]


# --------------------------------------------------------------------- numa-bind


def test_numa_bind_puts_a_containers_cards_on_one_numa_node() -> None:
    request = pod(container(memory_mib=1000, gpus=2), gpu_policy="binpack", numa_bind=True)
    # Without numa-bind binpack takes GPU-0 and GPU-2 (two NUMA nodes).
    out = placed(numa_node(), request)
    assert cards_of(out) == ["GPU-2", "GPU-3"]  # NUMA 1 completes a pair first
    spread = placed(numa_node(), pod(container(gpus=2), gpu_policy="spread", numa_bind=True))
    # Spread's order is GPU-1, GPU-3, GPU-2, GPU-0: NUMA 1 has two cards before NUMA 0 does.
    assert cards_of(spread) == ["GPU-3", "GPU-2"]


def test_numa_bind_refusals_say_whether_waiting_helps() -> None:
    request = pod(container(memory_mib=1000, gpus=2), numa_bind=True)
    split = node("split", card("GPU-0", 0, numa_node=0), card("GPU-1", 1, numa_node=1))
    fit = refused(split, request)
    assert fit.refusals[0].code is ReasonCode.TOO_FEW_CARDS and fit.permanent
    assert "on one NUMA node" in fit.refusals[0].message
    full = card("GPU-2", 2, numa_node=1, used_slots=10)
    busy = node("busy", card("GPU-0", 0, numa_node=0), card("GPU-1", 1, numa_node=1), full)
    fit = refused(busy, request)
    assert not fit.permanent
    assert "at most 1 on any one NUMA node now" in fit.refusals[0].message
    # One GPU per container: numa-bind changes nothing.
    placed(split, pod(container(), container("b", index=1), numa_bind=True))


def test_cards_without_a_numa_node_form_one_group() -> None:
    n = node("n", card("GPU-0", 0, numa_node=None), card("GPU-1", 1, numa_node=None))
    placed(n, pod(container(gpus=2), numa_bind=True))


# ---------------------------------------------------------------- topology-aware


@pytest.mark.parametrize("policy", ["binpack", "spread"])
def test_topology_aware_places_as_the_policy_without_link_data(policy: str) -> None:
    # HAMi picks the best-scored combination of fitting cards; with no pair scores every
    # combination scores the same and the first, the policy's own choice, wins. Tessera has
    # no link data, so the choice is the policy's.
    request = pod(container(memory_mib=1000, gpus=2), container("b", index=1), gpu_policy=policy)
    aware = pod(*request.containers, gpu_policy=f"topology-aware,{policy}")
    assert cards_of(placed(numa_node(), aware)) == cards_of(placed(numa_node(), request))


# ------------------------------------------------------------------- vgpu-mode


def test_a_mig_pod_is_admitted_and_then_fits_no_node() -> None:
    # Corpus h15: vgpu-mode mig, 2 x 8000 MiB. No Tessera card is in MIG mode: every node is
    # refused for good, never given ordinary shared slices.
    raw = pod_json(
        k8s_container(limits={"nvidia.com/gpu": 2, "nvidia.com/gpumem": 8000}),
        annotations={"nvidia.com/vgpu-mode": "mig", "hami.io/gpu-scheduler-policy": "binpack"},
    )
    request = parse_pod(raw)
    assert request is not None and request.vgpu_modes == ("mig",)
    snap = Snapshot.build([node("a100"), node("rtx")])
    feasible, failed = filter_nodes(snap, request, ["a100", "rtx"])
    assert feasible == [] and all(f.permanent for f in failed)
    [reason] = failed[0].refusals
    assert reason.code is ReasonCode.MODE_MISMATCH
    assert reason.message.startswith("no card is in MIG mode")
    # Bind places with place_on_node: it must refuse the same way, never hand out slices.
    assert place_on_node(node("a100"), request) == failed[0]


def test_hami_core_mode_is_tesseras_shared_slices() -> None:
    raw = pod_json(
        k8s_container(limits={"nvidia.com/gpu": 1}),
        annotations={"nvidia.com/vgpu-mode": "hami-core"},
    )
    request = parse_pod(raw)
    assert request is not None
    placed(node("a100"), request)
    both = pod(container(), vgpu_modes=("mig", "hami-core"))
    placed(node("a100"), both)


# ------------------------------------------------------- gpumem-percentage: 0


def test_zero_percentage_books_a_whole_card() -> None:
    raw = pod_json(k8s_container(limits={"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 0}))
    request = parse_pod(raw)
    assert request is not None
    [a] = placed(node("n", card("GPU-0", 0, memory_mib=L4_MIB)), request)
    assert (a.memory_mib, a.cores) == (L4_MIB, 0)
    refused(node("n", card("GPU-0", 0, used_memory_mib=1, used_slots=1)), request)


# ---------------------------------------------------------------------- sidecars


def test_a_sidecar_adds_to_later_init_containers() -> None:
    # One 24 GiB card: the init container (20 GiB) runs beside the sidecar started before it.
    one = node("n", card("GPU-0", 0, memory_mib=L4_MIB))
    side = container("proxy", init=True, index=0, memory_mib=5000, sidecar=True)
    init = container("convert", init=True, index=1, memory_mib=20480)
    app = container("server", memory_mib=10240)
    fit = refused(one, pod(side, init, app))
    assert fit.refusals[0].code is ReasonCode.INSUFFICIENT_MEMORY
    assert "init container 'convert'" in fit.refusals[0].message
    assert "after this pod's earlier containers" in fit.refusals[0].message
    # The same sidecar AFTER the init container does not overlap it (corpus d05's card).
    late = container("proxy", init=True, index=2, memory_mib=4000, sidecar=True)
    early = container("convert", init=True, index=1, memory_mib=20480)
    out = placed(one, pod(early, late, app))
    assert [(a.container_name, a.init, a.sidecar) for a in out] == [
        ("convert", True, False),
        ("proxy", True, True),
        ("server", False, False),
    ]
    [claim] = claims_per_card(a.to_claim() for a in out).values()
    assert (claim.memory_mib, claim.slots) == (20480, 2)  # max(20480, 4000 + 10240)


def test_a_sidecar_adds_to_the_app_containers() -> None:
    one = node("n", card("GPU-0", 0, memory_mib=L4_MIB))
    side = container("proxy", init=True, memory_mib=10000, sidecar=True)
    refused(one, pod(side, container("server", memory_mib=15000)))
    out = placed(one, pod(side, container("server", memory_mib=14000)))
    [claim] = claims_per_card(a.to_claim() for a in out).values()
    assert (claim.memory_mib, claim.slots) == (24000, 2)
    # A 100% sidecar keeps the app containers off its card, like an exclusive app container.
    hog = container("hog", init=True, memory_mib=100, cores=100, sidecar=True)
    fit = refused(one, pod(hog, container("server", memory_mib=100)))
    assert fit.refusals[0].code is ReasonCode.EXCLUSIVE_CONFLICT


def test_sidecars_count_in_the_score() -> None:
    n = node("n", card("GPU-0", 0), card("GPU-1", 1))  # 163840 MiB in all
    side = container("proxy", init=True, memory_mib=40960, sidecar=True)
    plain = container("proxy", init=True, memory_mib=40960)
    app = container("server", memory_mib=40960)
    # (40960 + 40960) / 163840 = 5/10 with the sidecar running beside the app; 2.5 -> 3
    # when it is an ordinary init container that ends first.
    assert score_node(n, pod(side, app)) == 5
    assert score_node(n, pod(plain, app)) == 3


def test_assignments_carry_the_priority() -> None:
    out = placed(node("n"), pod(container("a", priority=0), container("b", index=1)))
    assert [(a.container_name, a.priority) for a in out] == [("a", 0), ("b", None)]


def test_an_exclusive_app_container_does_not_share_with_a_sidecar() -> None:
    out = placed(node("n"), pod(container("s", init=True, sidecar=True), container("x", cores=100)))
    assert len({a.card_uuid for a in out}) == 2
    refused(node("n", card("GPU-0", 0)), pod(container("s", init=True, sidecar=True),
                                            container("x", cores=100)))  # fmt: skip
