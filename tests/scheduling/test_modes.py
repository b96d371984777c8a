"""Card modes in the core: MIG geometry and placement, MPS and exclusive lanes, draining cards.

The MIG property tests check placements against a brute force that re-reads each model's
geometry slice by slice (no bitmasks), so the core's masks are checked against the rule, not
against themselves.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.scheduling import (
    Assignment,
    NodeFit,
    NodeState,
    PodRequest,
    ReasonCode,
    RequestError,
    SchedulingConfig,
    Snapshot,
    filter_nodes,
    fit_node,
    mig,
    parse_pod,
    place_on_node,
)
from controlplane.scheduling.state import CARD_MODES
from tests.pods import container as k8s_container
from tests.scheduling.builders import card, container, node, pod, pod_json

PROFILE = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"
A30 = "NVIDIA A30"
A100_40 = "NVIDIA A100-PCIE-40GB"
MIG_MODELS = ("NVIDIA A100-SXM4-80GB", A100_40, H100, "NVIDIA H100 NVL", H200, A30)


def mig_card(uuid: str, index: int, model: str = "NVIDIA A100-SXM4-80GB", **kw: object) -> object:
    return card(uuid, index, model=model, mode="mig", mig_enabled=True, **kw)


def placed(n: NodeState, request: PodRequest) -> tuple[Assignment, ...]:
    result = place_on_node(n, request)
    assert not isinstance(result, NodeFit), result.summary()
    assert fit_node(n, request).feasible
    return result


def refused(n: NodeState, request: PodRequest) -> NodeFit:
    result = place_on_node(n, request)
    assert isinstance(result, NodeFit), result
    fit = fit_node(n, request)
    assert not fit.feasible and fit.refusals == result.refusals
    return fit


# ------------------------------------------------------------------------------ geometry


@pytest.mark.parametrize(
    ("model", "label"),
    [
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
        ("NVIDIA H100 80GB HBM3", "H100 80GB"),
        ("NVIDIA H100 PCIe", "H100 80GB"),
        ("NVIDIA H100 NVL", "H100 94GB"),
        ("NVIDIA H200", "H200 141GB"),
        ("NVIDIA H200 NVL", "H200 141GB"),
        ("NVIDIA GH200 480GB", "H100 96GB (GH200)"),
        ("NVIDIA A30", "A30 24GB"),
    ],
)
def test_geometry_by_nvml_name(model: str, label: str) -> None:
    found = mig.geometry_for(model)
    assert found is not None and found.name == label


@pytest.mark.parametrize(
    "model", ["NVIDIA L4", "Tesla T4", "NVIDIA A10", "NVIDIA GH200 144G HBM3e"]
)
def test_models_without_mig_have_no_geometry(model: str) -> None:
    assert mig.geometry_for(model) is None


def test_a100_placements_are_the_guides() -> None:
    g = mig.A100_80
    starts = {p.name: (p.starts, p.memory_slices, p.compute_slices) for p in g.profiles}
    assert starts == {
        "1g.10gb": ((0, 1, 2, 3, 4, 5, 6), 1, 1),
        "1g.10gb+me": ((0, 1, 2, 3, 4, 5, 6), 1, 1),
        "1g.20gb": ((0, 2, 4, 6), 2, 1),
        "2g.20gb": ((0, 2, 4), 2, 2),
        "3g.40gb": ((0, 4), 4, 3),
        "4g.40gb": ((0,), 4, 4),
        "7g.80gb": ((0,), 8, 7),
    }
    assert [g.compute_percent(p) for p in g.profiles] == [14, 14, 14, 28, 42, 57, 100]
    a30 = {p.name: (p.starts, p.memory_slices) for p in mig.A30.profiles}
    assert a30["1g.6gb"] == ((0, 1, 2, 3), 1) and a30["2g.12gb"] == ((0, 2), 2)
    assert a30["4g.24gb"] == ((0,), 4)


def test_every_placement_lies_on_the_card() -> None:
    for g in mig.GEOMETRIES:
        for p in g.profiles:
            assert p.memory_mib > 0 and 0 < p.compute_slices <= g.compute_slices
            for s in p.starts:
                assert s + p.memory_slices <= g.memory_slices, (g.name, p.name, s)


def test_profile_for_a_memory_ask() -> None:
    g = mig.A100_80
    assert mig.profile_for(g, 8000).name == "1g.10gb"  # type: ignore[union-attr]
    assert mig.profile_for(g, 15000).name == "1g.20gb"  # type: ignore[union-attr]
    assert mig.profile_for(g, 30000).name == "3g.40gb"  # type: ignore[union-attr]
    assert mig.profile_for(g, 50000).name == "7g.80gb"  # type: ignore[union-attr]
    assert mig.profile_for(g, 90000) is None


def test_a_placement_keeps_room_for_the_largest_profiles() -> None:
    g = mig.A100_80
    one = g.profile("1g.10gb")
    assert one is not None
    # At 6 the 4g (slices 0-3), one 3g (0-3) and all three 2g placements stay open.
    assert mig.choose_start(g, one, 0) == 6
    three = g.profile("3g.40gb")
    assert three is not None and mig.choose_start(g, three, one.mask(6)) == 0
    assert mig.choose_start(g, three, one.mask(6) | three.mask(0)) is None


# ------------------------------------------------------------------------- MIG in the core


def mig_pod(*containers: object, **kw: object) -> PodRequest:
    return pod(*containers, vgpu_modes=("mig",), **kw)  # type: ignore[arg-type]


def test_h15_shape_takes_1g_10gb_on_two_cards() -> None:
    n = node("a100", mig_card("GPU-0", 0), mig_card("GPU-1", 1))
    got = placed(n, mig_pod(container(gpus=2, memory_mib=8000)))
    assert sorted(a.card_uuid for a in got) == ["GPU-0", "GPU-1"]
    for a in got:
        assert (a.mode, a.mig_profile, a.mig_size) == ("mig", "1g.10gb", 1)
        assert (a.memory_mib, a.cores) == (9728, 14)


def test_a_shared_pod_never_lands_on_a_mig_card_and_a_mig_pod_never_on_a_shared_one() -> None:
    n = node("n", mig_card("GPU-0", 0), card("GPU-1", 1))
    [shared] = placed(n, pod(container()))
    assert (shared.card_uuid, shared.mode, shared.mig_profile) == ("GPU-1", "shared", "")
    [instance] = placed(n, mig_pod(container()))
    assert instance.card_uuid == "GPU-0" and instance.mode == "mig"
    # A pod's slices all go to cards of one mode: one shared and one MIG card do not make two.
    both = refused(n, pod(container(gpus=2), vgpu_modes=("hami-core", "mig")))
    assert "2 distinct MIG cards" in both.summary()
    [one_each] = placed(n, pod(container(), vgpu_modes=("mig", "hami-core")))
    assert one_each.mode == "mig"  # the pod's order: MIG first


def test_mig_card_full_says_which_profile_has_no_placement() -> None:
    taken = mig.A100_80.full  # every memory slice held
    n = node("n", mig_card("GPU-0", 0, mig_used=taken))
    fit = refused(n, mig_pod(container(memory_mib=30000)))
    [reason] = fit.refusals
    assert reason.code is ReasonCode.NO_MIG_PLACEMENT and not reason.permanent
    assert reason.message == (
        "card GPU-0 (NVIDIA A100-SXM4-80GB): MIG mode, no free 3g.40gb placement"
    )


def test_too_large_an_ask_for_any_profile_is_permanent() -> None:
    fit = refused(node("n", mig_card("GPU-0", 0)), mig_pod(container(memory_mib=90000)))
    assert fit.permanent and "the largest profile, 7g.80gb" in fit.summary()


def test_a_model_without_geometry_takes_no_instance() -> None:
    fit = refused(node("n", mig_card("GPU-0", 0, model="NVIDIA L4")), mig_pod(container()))
    assert fit.permanent and "knows no MIG profiles" in fit.summary()


def test_mig_set_but_not_enabled_places_nothing() -> None:
    n = node("n", card("GPU-0", 0, mode="mig", mig_enabled=False))
    fit = refused(n, mig_pod(container()))
    [reason] = fit.refusals
    assert reason.code is ReasonCode.MIG_NOT_ENABLED
    assert "MIG mode, but MIG is not yet enabled on the GPU" in reason.message


def test_mps_cards_take_only_mps_pods_and_fit_like_shared_ones() -> None:
    n = node("n", card("GPU-0", 0, mode="mps", used_memory_mib=80000, used_slots=1))
    fit = refused(n, pod(container()))
    assert fit.summary().startswith("no card is in shared mode")
    mps = pod(container(), vgpu_modes=("mps",))
    fit = refused(n, pod(container(memory_mib=4096), vgpu_modes=("mps",)))
    assert "GPU-0" in fit.summary() and fit.refusals[0].code is ReasonCode.INSUFFICIENT_MEMORY
    [a] = placed(n, mps)
    assert (a.mode, a.memory_mib) == ("mps", 1024)


def test_an_mps_card_among_shared_ones_says_the_pod_does_not_accept_mps() -> None:
    n = node("n", card("GPU-0", 0, mode="mps"), card("GPU-1", 1, used_slots=10))
    fit = refused(n, pod(container()))
    messages = [r.message for r in fit.refusals]
    assert (
        "card GPU-0 (NVIDIA A100-SXM4-80GB) is in MPS mode; the pod does not accept mps "
        "(nvidia.com/vgpu-mode)"
    ) in messages


def test_exclusive_cards_take_only_a_whole_card_slice() -> None:
    n = node("n", card("GPU-0", 0, mode="exclusive"))
    whole = pod(container(memory_mib=None, cores=100))
    [a] = placed(n, whole)
    assert (a.mode, a.memory_mib, a.cores) == ("exclusive", 81920, 100)
    fit = refused(n, pod(container()))
    assert "is in exclusive mode; it takes only a slice that is the whole card" in fit.summary()
    busy = node("n", card("GPU-0", 0, mode="exclusive", used_slots=1, used_compute=100,
                          used_memory_mib=81920, exclusive=True))  # fmt: skip
    refused(busy, whole)


def test_a_draining_card_takes_nothing_new() -> None:
    n = node("n", card("GPU-0", 0, draining=True), card("GPU-1", 1, draining=True, mode="mig",
                                                         mig_enabled=True))  # fmt: skip
    for request in (pod(container()), mig_pod(container())):
        fit = refused(n, request)
        assert all(r.code is ReasonCode.CARD_DRAINING for r in fit.refusals), fit.refusals
        assert "draining for a mode change" in fit.summary()


def test_filter_memoises_per_mode_not_across_modes() -> None:
    snap = Snapshot.build([node("s", card("GPU-s", 0)), node("p", card("GPU-p", 0, mode="mps"))])
    shared, _ = filter_nodes(snap, pod(container()), ["s", "p"])
    mps, _ = filter_nodes(snap, pod(container(), vgpu_modes=("mps",)), ["s", "p"])
    assert (shared, mps) == (["s"], ["p"])


# ------------------------------------------------------------------- mig-<profile> asks


def test_mig_profile_resources_are_ignored_unless_served() -> None:
    raw = pod_json(k8s_container(limits={"nvidia.com/mig-3g.40gb": 1}))
    assert parse_pod(raw) is None
    served = parse_pod(raw, SchedulingConfig(mig_resources=True))
    assert served is not None
    [c] = served.containers
    assert (c.mig_profile, c.gpus) == ("3g.40gb", 1) and served.plan.lanes == ("mig",)
    [a] = placed(node("n", mig_card("GPU-0", 0)), served)
    assert (a.mig_profile, a.mig_start, a.mig_size, a.memory_mib) == (
        "3g.40gb",
        4,
        4,
        40192,
    )  # 4g stays open
    # A 40 GB A100 has no 3g.40gb: the profile asked by name must exist on the model.
    fit = refused(node("n", mig_card("GPU-0", 0, model=A100_40)), served)
    assert "has no 3g.40gb profile" in fit.summary() and fit.permanent


LIMITS = "spec.containers[0].resources.limits."


@pytest.mark.parametrize(
    ("limits", "annotations", "field"),
    [
        ({"nvidia.com/mig-9g.1tb": 1}, {}, LIMITS + "nvidia.com/mig-9g.1tb"),
        ({"nvidia.com/mig-1g.10gb": 2, "nvidia.com/gpu": 1}, {}, LIMITS + "nvidia.com/gpu"),
        (
            {"nvidia.com/mig-1g.10gb": 1, "nvidia.com/gpumem": 100},
            {},
            LIMITS + "nvidia.com/mig-1g.10gb",
        ),
        (
            {"nvidia.com/mig-1g.10gb": 1, "nvidia.com/mig-2g.20gb": 1},
            {},
            "spec.containers[0].resources",
        ),
        (
            {"nvidia.com/mig-1g.10gb": 1},
            {"nvidia.com/vgpu-mode": "mps"},
            "metadata.annotations.nvidia.com/vgpu-mode",
        ),
    ],
)
def test_bad_mig_profile_asks_name_the_field(
    limits: dict[str, object], annotations: dict[str, str], field: str
) -> None:
    raw = pod_json(k8s_container(limits=limits), annotations=annotations)
    with pytest.raises(RequestError) as caught:
        parse_pod(raw, SchedulingConfig(mig_resources=True))
    assert caught.value.field == field


def test_default_vgpu_modes_apply_to_pods_that_do_not_say() -> None:
    raw = pod_json(k8s_container(limits={"nvidia.com/gpu": 1}))
    request = parse_pod(raw, SchedulingConfig(default_vgpu_modes=("hami-core", "mig")))
    assert request is not None and request.plan.lanes == ("shared", "mig")
    with pytest.raises(ValueError, match="default_vgpu_modes"):
        SchedulingConfig(default_vgpu_modes=("vmware",))


# ------------------------------------------------------------------------ properties


def brute_free(model: str, taken: list[tuple[int, int]], name: str) -> list[int]:
    """Starts of profile `name` whose slices no taken (start, size) covers, slice by slice."""
    geometry = mig.geometry_for(model)
    assert geometry is not None
    profile = geometry.profile(name)
    assert profile is not None
    used = [False] * geometry.memory_slices
    for start, size in taken:
        for i in range(start, start + size):
            assert not used[i], "two instances share memory slice"
            used[i] = True
    return [
        s for s in profile.starts if not any(used[i] for i in range(s, s + profile.memory_slices))
    ]


@st.composite
def mig_nodes(draw: st.DrawFn) -> NodeState:
    n = draw(st.integers(1, 3))
    cards = []
    for i in range(n):
        model = draw(st.sampled_from(MIG_MODELS))
        mode = draw(st.sampled_from(CARD_MODES))
        cards.append(
            card(
                f"GPU-{i}",
                i,
                model=model,
                mode=mode,
                mig_enabled=draw(st.integers(0, 4)) > 0,
                draining=draw(st.integers(0, 9)) == 0,
            )
        )
    return node("n", *cards)


@st.composite
def mode_pods(draw: st.DrawFn) -> PodRequest:
    modes = draw(st.lists(st.sampled_from(("hami-core", "mig", "mps")), unique=True, max_size=3))
    whole = draw(st.integers(0, 5)) == 0
    gpus = draw(st.integers(1, 3))
    if whole:
        c = container(gpus=gpus, memory_mib=None, cores=100)
    else:
        c = container(gpus=gpus, memory_mib=draw(st.integers(1, 90000)),
                      cores=draw(st.sampled_from((0, 10, 50))))  # fmt: skip
    return pod(c, vgpu_modes=tuple(modes), gpu_policy=draw(st.sampled_from(("binpack", "spread"))))


def accepted_modes(request: PodRequest) -> set[str]:
    out: set[str] = set()
    for m in request.vgpu_modes or ("hami-core",):
        out |= {"shared", "exclusive"} if m == "hami-core" else {m}
    return out


def apply(n: NodeState, got: tuple[Assignment, ...]) -> NodeState:
    """The node after the pod's slices, as the ledger would read it back."""
    cards = []
    for c in n.cards:
        mine = [a for a in got if a.card_uuid == c.uuid]
        mask = c.mig_used
        for a in mine:
            mask |= ((1 << a.mig_size) - 1) << a.mig_start
        cards.append(
            replace(
                c,
                used_memory_mib=c.used_memory_mib + sum(a.memory_mib for a in mine),
                used_compute=c.used_compute + sum(a.cores for a in mine),
                used_slots=c.used_slots + len(mine),
                exclusive=c.exclusive or any(a.cores >= 100 for a in mine),
                mig_used=mask,
            )
        )
    return NodeState(n.name, n.ready, n.cordoned, tuple(cards))


@PROFILE
@given(n=mig_nodes(), pods=st.lists(mode_pods(), min_size=1, max_size=6))
def test_cards_only_take_their_own_modes_slices_and_instances_never_overlap(
    n: NodeState, pods: list[PodRequest]
) -> None:
    taken: dict[str, list[tuple[int, int]]] = {c.uuid: [] for c in n.cards}
    by_uuid = {c.uuid: c for c in n.cards}
    for request in pods:
        fit = fit_node(n, request)
        got = place_on_node(n, request)
        feasible, _ = filter_nodes(Snapshot.build([n]), request, [n.name])
        # The filter, fit_node and the placement agree.
        assert fit.feasible == (not isinstance(got, NodeFit)) == (feasible == [n.name])
        if isinstance(got, NodeFit):
            assert got.refusals and all(r.message for r in got.refusals)
            continue
        modes = {a.mode for a in got}
        assert len(modes) == 1 and modes <= accepted_modes(request)
        for a in got:
            c = by_uuid[a.card_uuid]
            assert c.mode == a.mode and not c.draining and c.healthy
            if a.mode == "exclusive":
                assert (a.memory_mib, a.cores) == (c.memory_mib, 100)
            if a.mode == "mig":
                assert c.mig_enabled
                free = brute_free(c.model, taken[c.uuid], a.mig_profile)
                assert a.mig_start in free, (a, taken[c.uuid])
                geometry = mig.geometry_for(c.model)
                assert geometry is not None
                profile = geometry.profile(a.mig_profile)
                assert profile is not None and a.mig_size == profile.memory_slices
                assert (
                    a.memory_mib
                    == profile.memory_mib
                    >= request.containers[0].memory_on(c.memory_mib)
                    or request.containers[0].memory_mib is None
                )
                taken[c.uuid].append((a.mig_start, a.mig_size))
                brute_free(c.model, taken[c.uuid], a.mig_profile)  # asserts no overlap
            else:
                assert not a.mig_profile and a.mig_size == 0
        per_container = [a.card_uuid for a in got]
        assert len(per_container) == len(set(per_container))  # distinct cards
        n = apply(n, got)


@PROFILE
@given(
    model=st.sampled_from(MIG_MODELS),
    asks=st.lists(st.integers(1, 140000), min_size=1, max_size=12),
    spread=st.booleans(),
)
def test_mig_fit_agrees_with_a_brute_force_search(
    model: str, asks: list[int], spread: bool
) -> None:
    """One card, instances one after another: the core places one exactly when some allowed
    start of the smallest profile that holds the ask is free (counted slice by slice)."""
    geometry = mig.geometry_for(model)
    assert geometry is not None
    n = node("n", mig_card("GPU-0", 0, model=model))
    taken: list[tuple[int, int]] = []
    for mib in asks:
        request = mig_pod(container(memory_mib=mib), gpu_policy="spread" if spread else "binpack")
        fitting = [p for p in geometry.profiles if not p.media and p.memory_mib >= mib]
        want = min(fitting, key=lambda p: (p.memory_mib, p.compute_slices), default=None)
        got = place_on_node(n, request)
        if want is None or not brute_free(model, taken, want.name):
            assert isinstance(got, NodeFit) and not fit_node(n, request).feasible
            continue
        assert not isinstance(got, NodeFit)
        [a] = got
        assert a.mig_profile == want.name and a.mig_start in brute_free(model, taken, want.name)
        taken.append((a.mig_start, a.mig_size))
        n = apply(n, got)
