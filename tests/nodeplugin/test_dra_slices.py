"""The ResourceSlices built from the node's cards, per card mode and health (docs/dra.md)."""

from __future__ import annotations

from typing import Any

import pytest

from nodeplugin.cards import Card, Health
from nodeplugin.dra_claims import quantity
from nodeplugin.dra_slices import (
    DRIVER,
    UNHEALTHY_TAINT,
    MigLayout,
    MigOffer,
    NodeVersions,
    Pool,
    SliceError,
    build_slices,
    semver,
    slice_name,
)

A = Card("GPU-a", 0, "NVIDIA A100-SXM4-80GB", 81920, 0, 0, "00000000:3B:00.0")
B = Card("GPU-b", 1, "NVIDIA A100-SXM4-80GB", 81920, 1, None)
A100_MIG = MigLayout(
    8,
    (
        MigOffer("3g.40gb", 0, 4, 40192),
        MigOffer("3g.40gb", 4, 4, 40192),
        MigOffer("1g.10gb+me", 6, 1, 9984),
    ),
)


def build(
    cards: list[Card] | None = None,
    modes: dict[str, str] | None = None,
    health: dict[str, Health] | None = None,
    **kw: Any,
) -> list[dict[str, Any]]:
    return build_slices(
        "node-1",
        cards if cards is not None else [B, A],
        modes=modes or {},
        health=health or {},
        slots=kw.pop("slots", 10),
        generation=kw.pop("generation", 7),
        **kw,
    )


def devices(slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in slices[0]["spec"]["devices"]}


def test_one_pool_per_node_in_the_v1_api() -> None:
    (s,) = build()
    assert s["apiVersion"] == "resource.k8s.io/v1"
    assert s["kind"] == "ResourceSlice"
    assert s["spec"]["driver"] == DRIVER
    assert s["spec"]["nodeName"] == "node-1"
    assert s["spec"]["pool"] == {"name": "node-1", "generation": 7, "resourceSliceCount": 1}
    assert [d["name"] for d in s["spec"]["devices"]] == ["gpu-0", "gpu-1"]  # by index


def test_shared_card_is_consumable_under_tessera_slice_rules() -> None:
    d = devices(build(slots=4))["gpu-0"]
    assert d["allowMultipleAllocations"] is True
    cap = d["capacity"]
    # Memory: whole MiB, the whole card when a claim does not ask (HAMi's default).
    assert cap["memory"] == {
        "value": "81920Mi",
        "requestPolicy": {"default": "81920Mi", "validRange": {"min": "1Mi", "step": "1Mi"}},
    }
    # Compute: whole percent 0..100, none when not asked.
    assert cap["compute"]["value"] == "100"
    assert cap["compute"]["requestPolicy"] == {
        "default": "0",
        "validRange": {"min": "0", "max": "100", "step": "1"},
    }
    # Every allocation takes exactly one of the card's slots.
    assert cap["slots"] == {"value": "4", "requestPolicy": {"default": "1", "validValues": ["1"]}}


def test_attributes_say_which_card_it_is() -> None:
    attrs = devices(build(versions=NodeVersions("535.104.05", "12.4")))["gpu-0"]["attributes"]
    assert attrs == {
        "uuid": {"string": "GPU-a"},
        "model": {"string": "NVIDIA A100-SXM4-80GB"},
        "index": {"int": 0},
        "mode": {"string": "shared"},
        "resource.kubernetes.io/pciBusID": {"string": "00000000:3B:00.0"},
        "resource.kubernetes.io/numaNode": {"int": 0},
        "driverVersion": {"version": "535.104.5"},
        "cudaVersion": {"version": "12.4.0"},
    }
    # Unknown NUMA node, PCI bus and versions are left out, never made up.
    attrs_b = devices(build())["gpu-1"]["attributes"]
    assert set(attrs_b) == {"uuid", "model", "index", "mode"}


def test_long_model_is_cut_to_the_api_limit() -> None:
    card = Card("GPU-x", 0, "X" * 80, 1024, 0)
    assert devices(build([card]))["gpu-0"]["attributes"]["model"] == {"string": "X" * 64}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("550.54.15", "550.54.15"),
        ("535.104.05", "535.104.5"),
        ("12.4", "12.4.0"),
        ("12", "12.0.0"),
        ("", None),
        ("r550", None),
        ("1.2.3.4", None),
    ],
)
def test_versions_become_semver_or_nothing(raw: str, expected: str | None) -> None:
    assert semver(raw) == expected


def test_mps_card_shares_like_a_shared_card_but_says_its_mode() -> None:
    d = devices(build(modes={"GPU-a": "mps"}))
    assert d["gpu-0"]["allowMultipleAllocations"] is True
    assert d["gpu-0"]["capacity"] == d["gpu-1"]["capacity"]
    assert d["gpu-0"]["attributes"]["mode"] == {"string": "mps"}


def test_exclusive_card_is_taken_whole_by_one_claim() -> None:
    d = devices(build(modes={"GPU-a": "exclusive"}))["gpu-0"]
    assert "allowMultipleAllocations" not in d
    # A request policy is only allowed on a device that allows multiple allocations.
    assert d["capacity"] == {"memory": {"value": "81920Mi"}, "compute": {"value": "100"}}
    assert d["attributes"]["mode"] == {"string": "exclusive"}


def test_mig_card_offers_placements_that_consume_its_memory_slices() -> None:
    slices = build(modes={"GPU-a": "mig"}, mig={"GPU-a": A100_MIG})
    assert len(slices) == 2
    for s in slices:
        assert s["spec"]["pool"] == {"name": "node-1", "generation": 7, "resourceSliceCount": 2}
    # Counter sets live in a slice of their own (a slice holds devices or counters, not both).
    counters = slices[1]["spec"]
    assert "devices" not in counters
    assert counters["sharedCounters"] == [
        {
            "name": "gpu-0-slices",
            "counters": {f"memory-slice-{k}": {"value": "1"} for k in range(8)},
        }
    ]
    assert slices[1]["metadata"]["name"] != slices[0]["metadata"]["name"]
    d = devices(slices)
    assert set(d) == {
        "gpu-0-mig-3g-40gb-0",
        "gpu-0-mig-3g-40gb-4",
        "gpu-0-mig-1g-10gb-me-6",
        "gpu-1",
    }
    second = d["gpu-0-mig-3g-40gb-4"]
    assert "allowMultipleAllocations" not in second
    assert second["capacity"] == {"memory": {"value": "40192Mi"}}
    assert second["attributes"]["profile"] == {"string": "3g.40gb"}
    assert second["attributes"]["uuid"] == {"string": "GPU-a"}
    used = {
        name: set(dev["consumesCounters"][0]["counters"])
        for name, dev in d.items()
        if "consumesCounters" in dev
    }
    # Overlapping placements share a counter of value 1, so they are never allocated together.
    assert used["gpu-0-mig-3g-40gb-4"] & used["gpu-0-mig-1g-10gb-me-6"] == {"memory-slice-6"}
    assert not used["gpu-0-mig-3g-40gb-0"] & used["gpu-0-mig-3g-40gb-4"]


def test_mig_card_without_a_layout_offers_nothing_yet() -> None:
    slices = build(modes={"GPU-a": "mig"})
    assert len(slices) == 1
    assert set(devices(slices)) == {"gpu-1"}


def test_mig_placement_outside_the_card_is_refused() -> None:
    bad = MigLayout(8, (MigOffer("4g.40gb", 6, 4, 40192),))
    with pytest.raises(SliceError, match="outside its 8 memory slices"):
        build(modes={"GPU-a": "mig"}, mig={"GPU-a": bad})


def test_unhealthy_card_is_tainted_not_left_out() -> None:
    d = devices(build(health={"GPU-b": Health(False, "XID 79")}))
    assert d["gpu-1"]["taints"] == [{"key": UNHEALTHY_TAINT, "effect": "NoSchedule"}]
    assert "taints" not in d["gpu-0"]
    mig = devices(
        build(modes={"GPU-a": "mig"}, mig={"GPU-a": A100_MIG}, health={"GPU-a": Health(False)})
    )
    assert all(dev["taints"] for name, dev in mig.items() if name.startswith("gpu-0-"))


def test_recovered_card_loses_its_taint() -> None:
    d = devices(build(health={"GPU-b": Health(True)}))
    assert "taints" not in d["gpu-1"]


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(SliceError, match="unknown mode 'vgpu'"):
        build(modes={"GPU-a": "vgpu"})


def test_a_pool_past_one_slices_limits_goes_on_in_further_slices() -> None:
    cards = [Card(f"GPU-{i}", i, "L4", 23034, i) for i in range(130)]
    plain = build(cards)  # 128 plain devices to a slice
    assert [len(x["spec"]["devices"]) for x in plain] == [128, 2]
    tainted = build(cards, health={"GPU-0": Health(False)})  # 64 once one has a taint
    assert [len(x["spec"]["devices"]) for x in tainted] == [64, 64, 2]
    names = [x["metadata"]["name"] for x in tainted]
    assert names == [
        slice_name("node-1"),
        slice_name("node-1", part=1),
        slice_name("node-1", part=2),
    ]
    assert len(set(names)) == 3
    assert all(x["spec"]["pool"]["resourceSliceCount"] == 3 for x in tainted)
    every = [d["name"] for x in tainted for d in x["spec"]["devices"]]
    assert every == [f"gpu-{i}" for i in range(130)]  # each once, in card order
    # Nine MIG cards: their placements and nine counter sets (eight to a slice) spread too.
    mig_cards = [Card(f"GPU-m{i}", i, "NVIDIA A100-SXM4-40GB", 40960, i) for i in range(9)]
    layouts = {c.uuid: A100_MIG for c in mig_cards}
    pool = build(mig_cards, modes=dict.fromkeys(layouts, "mig"), mig=layouts)
    counter_slices = [x for x in pool if "sharedCounters" in x["spec"]]
    assert [len(x["spec"]["sharedCounters"]) for x in counter_slices] == [8, 1]
    assert all(len(x["spec"].get("devices", ())) <= 64 for x in pool)
    assert sum(len(x["spec"].get("devices", ())) for x in pool) == 9 * len(A100_MIG.offers)
    assert all(x["spec"]["pool"]["resourceSliceCount"] == len(pool) for x in pool)


def test_no_cards_gives_an_empty_pool() -> None:
    (s,) = build([])
    assert s["spec"]["devices"] == []


def _api_accepts(value: int, policy: dict[str, Any]) -> bool:
    """kube-apiserver's checks of a request policy (pkg/apis/resource/validation,
    validateRequestPolicyRange and validateRequestPolicyValidValues), on whole numbers."""
    default = quantity(policy["default"], "default")
    if "validValues" in policy:
        values = [quantity(v, "v") for v in policy["validValues"]]
        return values == sorted(values) and default in values and max(values) <= value
    r = policy["validRange"]
    low = quantity(r["min"], "min")
    high = quantity(r["max"], "max") if "max" in r else value
    step = quantity(r["step"], "step") if "step" in r else 1
    return (
        low <= default <= high <= value
        and low + step <= value
        and (default - low) % step == 0
        and (high - low) % step == 0
    )


@pytest.mark.parametrize("mode", ["shared", "mps"])
def test_request_policies_pass_the_api_servers_validation(mode: str) -> None:
    card = Card("GPU-s", 0, "L4", 23034, 0)
    (device,) = build([card], modes={"GPU-s": mode}, slots=3)[0]["spec"]["devices"]
    for name, cap in device["capacity"].items():
        assert _api_accepts(quantity(cap["value"], name), cap["requestPolicy"]), name


def test_pool_moves_to_a_new_generation_exactly_when_its_content_changes() -> None:
    pool = Pool(generation=41)  # continues from the API server's after a restart

    def update(**kw: Any) -> list[dict[str, Any]] | None:
        return pool.update(lambda generation: build([A, B], generation=generation, **kw))

    first = update()
    assert first is not None and first[0]["spec"]["pool"]["generation"] == 42
    assert update() is None  # a heartbeat with nothing new publishes nothing
    sick = update(health={"GPU-a": Health(False, "XID 79")})
    assert sick is not None and sick[0]["spec"]["pool"]["generation"] == 43
    assert devices(sick)["gpu-0"]["taints"]
    well = update()
    assert well is not None and "taints" not in devices(well)["gpu-0"]
    assert well[0]["spec"]["pool"]["generation"] == 44
    exclusive = update(modes={"GPU-b": "exclusive"})
    assert exclusive is not None and exclusive[0]["spec"]["pool"]["generation"] == 45
    assert "allowMultipleAllocations" not in devices(exclusive)["gpu-1"]
    # A node whose MIG card grows a counters slice moves both slices to one generation.
    mig = update(modes={"GPU-a": "mig"}, mig={"GPU-a": A100_MIG})
    assert mig is not None and [s["spec"]["pool"]["generation"] for s in mig] == [46, 46]
