"""A prepared claim's CDI spec, and the checkpoint of prepared claims (docs/dra.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nodeplugin import edits
from nodeplugin.allocation import ContainerAllocation, MigPlacement, SliceDevice
from nodeplugin.cards import Card
from nodeplugin.dra_claims import (
    CheckpointError,
    ClaimError,
    ClaimPreparer,
    ClaimStore,
    Published,
    claim_plan,
    quantity,
)
from nodeplugin.dra_slices import DRIVER, MigLayout, MigOffer
from nodeplugin.writer import Writer

NODE = "node-1"
A = Card("GPU-a", 0, "A100", 81920, 0, 0)
B = Card("GPU-b", 1, "A100", 81920, 3, 1)
CARDS = [A, B]
CONTROL = ["nvidiactl"]


def result(
    device: str,
    memory: str | None = "8Gi",
    compute: str = "30",
    *,
    pool: str = NODE,
    driver: str = DRIVER,
    request: str = "gpu",
) -> dict[str, Any]:
    r: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if memory is not None:
        r["shareID"] = f"share-{device}"
        r["consumedCapacity"] = {"memory": memory, "compute": compute, "slots": "1"}
    return r


def claim(*results: dict[str, Any], uid: str = "u-1") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "train-gpu", "namespace": "ml", "uid": uid},
        "status": {
            "allocation": {"devices": {"results": list(results)}},
            "reservedFor": [{"resource": "pods", "name": "train", "uid": "pod-uid"}],
        },
    }


def layout(tmp_path: Path) -> edits.Layout:
    return edits.Layout(
        dev_root=Path("/dev"),
        region_dir=tmp_path / "regions",
        region_container_dir="/var/run/tessera",
        state_dir=tmp_path / "state",
        config_container_dir="/etc/tessera",
        shim_library=Path("/opt/tessera/libtessera.so"),
        shim_container_path="/usr/local/tessera/lib/libtessera.so",
        preload=True,
    )


def writer(tmp_path: Path) -> Writer:
    w = Writer("cdi", tmp_path / "cdi", "tessera.io/gpu", layout(tmp_path), CONTROL)
    w.prepare()
    return w


def preparer(tmp_path: Path) -> ClaimPreparer:
    return ClaimPreparer(writer(tmp_path), ClaimStore(tmp_path / "state"))


def spec_env(path: Path) -> dict[str, str]:
    spec = json.loads(path.read_text())
    env = spec["devices"][0]["containerEdits"]["env"]
    return dict(e.split("=", 1) for e in env)


def node(modes: dict[str, str] | None = None, **kw: Any) -> Published:
    return Published(NODE, tuple(CARDS), modes or {}, **kw)


def plan_of(
    c: dict[str, Any], modes: dict[str, str] | None = None, **kw: Any
) -> edits.ContainerPlan:
    plan, _ = claim_plan(c, node(modes, **kw))
    return plan


# --- the plan and its CDI spec -----------------------------------------------------------


def test_consumed_capacity_becomes_the_shims_limits_in_result_order(tmp_path: Path) -> None:
    plan = plan_of(claim(result("gpu-1", "8Gi", "30"), result("gpu-0", "1536Mi", "0")))
    spec = edits.cdi_spec("tessera.io/gpu", plan, layout(tmp_path), CONTROL)
    env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])  # type: ignore[index]
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-b,GPU-a"  # the results' order
    assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "8192"
    assert env["TESSERA_DEVICE_CORE_LIMIT_0"] == "30"
    assert env["TESSERA_DEVICE_MEMORY_LIMIT_1"] == "1536"
    assert env["TESSERA_DEVICE_CORE_LIMIT_1"] == "0"
    assert env["TESSERA_ALLOCATION"] == "claim-u-1"
    assert plan.namespace == "ml" and plan.pod == "train" and plan.pod_uid == "pod-uid"


def test_the_spec_is_the_device_plugins_spec_for_the_same_slices(tmp_path: Path) -> None:
    plan = plan_of(claim(result("gpu-1", "4000Mi", "30"), result("gpu-0", "2000Mi", "0")))
    same = edits.make_plan(
        "claim-u-1",
        ContainerAllocation(
            "", 0, False, (SliceDevice("GPU-b", 4000, 30), SliceDevice("GPU-a", 2000, 0))
        ),
        {c.uuid: c for c in CARDS},
        namespace="ml",
        pod="train",
        pod_uid="pod-uid",
    )
    lay = layout(tmp_path)
    assert edits.cdi_spec("k/gpu", plan, lay, CONTROL) == edits.cdi_spec(
        "k/gpu", same, lay, CONTROL
    )


def test_exclusive_card_is_given_whole_without_limits() -> None:
    c = claim({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"})
    plan = plan_of(c, {"GPU-a": "exclusive"})
    (d,) = plan.devices
    assert (d.mode, d.memory_mib, d.cores) == ("exclusive", 81920, 100)
    assert edits.limit_env(plan.devices) == {}


def test_mig_device_carries_its_placement() -> None:
    mig = {"GPU-a": MigLayout(8, (MigOffer("3g.40gb", 4, 4, 40192),))}
    c = claim({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0-mig-3g-40gb-4"})
    (d,) = plan_of(c, {"GPU-a": "mig"}, mig=mig).devices
    assert d.mode == "mig"
    assert d.mig == MigPlacement("3g.40gb", 4, 4)
    assert d.memory_mib == 40192


def test_other_drivers_results_are_left_to_them() -> None:
    plan = plan_of(claim(result("nic-0", driver="net.example.com"), result("gpu-1")))
    assert [d.card.uuid for d in plan.devices] == ["GPU-b"]


@pytest.mark.parametrize(
    ("c", "message"),
    [
        (claim(result("gpu-0", pool="node-2")), "pool 'node-2', not this node's"),
        (claim(result("gpu-0", driver="gpu.nvidia.com")), "no device of driver gpu.tessera.io"),
        (claim(result("gpu-7")), "publishes no such device"),
        (claim(result("gpu-0", "96Gi")), "consumes 98304 MiB of card GPU-a, which has 81920"),
        (claim(result("gpu-0", "8Gi", "101")), "101% compute of card GPU-a; at most 100"),
        (claim(result("gpu-0", "1500Ki")), "not a whole number of MiB"),
        (claim(result("gpu-0", "0.5Gi")), "not a whole-number quantity"),
        (claim(result("gpu-0", None)), "no consumedCapacity"),
        (claim(result("gpu-0"), result("gpu-0", request="b")), "second allocation on card GPU-a"),
        ({"metadata": {"uid": "u", "name": "x", "namespace": "n"}, "status": {}}, "not allocated"),
    ],
    ids=[
        "other-node",
        "other-driver",
        "unknown-device",
        "more-memory-than-the-card",
        "more-compute-than-the-card",
        "partial-mib",
        "fraction",
        "no-consumed-capacity",
        "same-card-twice",
        "unallocated",
    ],
)
def test_claims_this_plugin_must_not_prepare_are_refused_with_the_reason(
    c: dict[str, Any], message: str
) -> None:
    with pytest.raises(ClaimError, match=message):
        plan_of(c)


def test_a_card_now_in_mig_mode_no_longer_has_its_whole_card_device() -> None:
    with pytest.raises(ClaimError, match="publishes no such device"):
        plan_of(claim(result("gpu-0")), {"GPU-a": "mig"})


@pytest.mark.parametrize(
    ("text", "value"), [("80Gi", 80 << 30), ("8448Mi", 8448 << 20), ("30", 30), ("2k", 2000)]
)
def test_quantities_as_the_allocator_writes_them(text: str, value: int) -> None:
    assert quantity(text, "x") == value


# --- prepare, unprepare, checkpoint ------------------------------------------------------


def test_prepare_writes_spec_region_and_checkpoint(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    done = p.prepare(claim(result("gpu-1")), node())
    assert done.cdi_id == "tessera.io/gpu=claim-u-1"
    assert [(d.device, d.share_id, d.memory_mib, d.cores) for d in done.devices] == [
        ("gpu-1", "share-gpu-1", 8192, 30)
    ]
    spec = p.writer.cdi_path("claim-u-1")
    assert spec_env(spec)["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "8192"
    assert (tmp_path / "regions" / "claim-u-1").is_dir()
    saved = json.loads((tmp_path / "state" / "dra" / "claims.json").read_text())
    assert list(saved["claims"]) == ["u-1"]


def test_prepare_twice_is_once(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    first = p.prepare(claim(result("gpu-1")), node())
    spec = p.writer.cdi_path("claim-u-1")
    checkpoint = tmp_path / "state" / "dra" / "claims.json"
    stamps = (spec.stat().st_mtime_ns, checkpoint.stat().st_mtime_ns)
    assert p.prepare(claim(result("gpu-1")), node()) == first
    assert (spec.stat().st_mtime_ns, checkpoint.stat().st_mtime_ns) == stamps
    assert len(p.store.all()) == 1
    assert len(list((tmp_path / "cdi").iterdir())) == 1


def test_a_restarted_plugin_neither_loses_nor_doubles_a_claim(tmp_path: Path) -> None:
    first = preparer(tmp_path).prepare(claim(result("gpu-1")), node())
    again = preparer(tmp_path)  # a new process: the checkpoint is loaded
    assert again.store.get("u-1") == first
    assert again.prepare(claim(result("gpu-1")), node()) == first
    assert len(again.store.all()) == 1
    again.unprepare("u-1")  # the claim may be gone: unprepare works from the checkpoint alone
    assert not again.writer.cdi_path("claim-u-1").exists()
    assert not (tmp_path / "regions" / "claim-u-1").exists()
    assert ClaimStore(tmp_path / "state").all() == []


def test_prepare_restores_a_spec_a_reboot_removed(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    p.prepare(claim(result("gpu-1")), node())
    p.writer.cdi_path("claim-u-1").unlink()
    p.prepare(claim(result("gpu-1")), node())
    assert spec_env(p.writer.cdi_path("claim-u-1"))["TESSERA_DEVICE_CORE_LIMIT_0"] == "30"


def test_unprepare_of_an_unknown_claim_is_not_an_error(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    p.prepare(claim(result("gpu-1")), node())
    p.unprepare("never-prepared")
    p.unprepare("u-1")
    p.unprepare("u-1")
    assert p.store.all() == []
    assert list((tmp_path / "cdi").iterdir()) == []


def test_a_refused_claim_writes_nothing(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    with pytest.raises(ClaimError):
        p.prepare(claim(result("gpu-1", pool="node-2")), node())
    assert list((tmp_path / "cdi").iterdir()) == []
    assert not (tmp_path / "state" / "dra" / "claims.json").exists()


def test_an_exclusive_card_is_never_prepared_for_two_claims(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    whole = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}
    p.prepare(claim(whole, uid="u-1"), node({"GPU-a": "exclusive"}))
    with pytest.raises(ClaimError, match="already prepared for another claim"):
        p.prepare(claim(whole, uid="u-2"), node({"GPU-a": "exclusive"}))
    assert not p.writer.cdi_path("claim-u-2").exists()


def test_shared_claims_beyond_the_cards_memory_are_refused(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    p.prepare(claim(result("gpu-0", "60Gi"), uid="u-1"), node())
    p.prepare(claim(result("gpu-0", "20Gi"), uid="u-2"), node())
    with pytest.raises(
        ClaimError, match="30720 MiB asked, 81920 MiB of 81920 MiB already prepared"
    ):
        p.prepare(claim(result("gpu-0", "30Gi"), uid="u-3"), node())


def test_an_unreadable_checkpoint_stops_the_plugin_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "state" / "dra" / "claims.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="remove the file"):
        ClaimStore(tmp_path / "state")


def test_a_checkpoint_entry_without_mig_fields_loads_as_a_claim_without_mig(
    tmp_path: Path,
) -> None:
    """An entry whose devices lack the MIG fields reads back as a claim without MIG devices."""
    done = preparer(tmp_path).prepare(claim(result("gpu-1")), node())
    path = tmp_path / "state" / "dra" / "claims.json"
    data = json.loads(path.read_text())
    for d in data["claims"]["u-1"]["devices"]:
        for key in ("mig_uuid", "mig_gi", "mig_ci"):
            del d[key]
    path.write_text(json.dumps(data))
    assert ClaimStore(tmp_path / "state").get("u-1") == done


def test_a_claim_of_two_requests_is_one_spec_per_request(tmp_path: Path) -> None:
    p = preparer(tmp_path)
    c = claim(result("gpu-0", "2Gi", "10", request="a"), result("gpu-1", request="b/x"))
    done = p.prepare(c, node())
    assert done.plan_names() == {"a": "claim-u-1-a", "b": "claim-u-1-b"}
    assert done.cdi_ids()["b"] == "tessera.io/gpu=claim-u-1-b"
    a, b = (spec_env(p.writer.cdi_path(n)) for n in ("claim-u-1-a", "claim-u-1-b"))
    assert (a["NVIDIA_VISIBLE_DEVICES"], a["TESSERA_DEVICE_MEMORY_LIMIT_0"]) == ("GPU-a", "2048")
    assert (b["NVIDIA_VISIBLE_DEVICES"], b["TESSERA_DEVICE_MEMORY_LIMIT_0"]) == ("GPU-b", "8192")
    assert not p.writer.cdi_path("claim-u-1").exists()
    p.unprepare("u-1")
    assert list((tmp_path / "cdi").iterdir()) == [] and p.store.all() == []
