"""The node plugin in DRA mode against a kubelet speaking the real gRPC APIs (registration,
DRAPlugin v1) and an API server holding claims and slices (docs/dra.md)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from nodeplugin import config
from nodeplugin.dra_claims import ClaimDevice, PreparedClaim
from nodeplugin.dra_plugin import prepare_answer
from nodeplugin.dra_rpc import DRA_SERVICE, DRA_SUPPORTED_VERSION
from nodeplugin.dra_slices import DRIVER, UNHEALTHY_TAINT
from nodeplugin.pb import dra, reg
from tests.nodeplugin.conftest import eventually, run
from tests.nodeplugin.harness.controlplane import FakeControlPlane
from tests.nodeplugin.harness.dra import FakeDraKubelet, FakeKubeApi, container_cdi_ids
from tests.nodeplugin.harness.gpu import GpuNode, cards
from tests.nodeplugin.harness.kubelet import FakeKubelet
from tests.nodeplugin.harness.plugin import NODE, PluginProcess

KUBE_TOKEN = "kube-token-of-the-plugin"
BASE = {"TESSERA_NODE_NAME": "n1", "TESSERA_CONTROLPLANE_URL": "http://cp:8000/"}


# -- the wire and the settings ---------------------------------------------------------------


def test_the_protos_carry_the_kubelets_names_and_numbers() -> None:
    """Names and numbers of k8s.io/kubelet v0.37.2 pkg/apis/{dra,pluginregistration}/v1."""
    assert dra.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert dra.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == DRA_SERVICE
    device = dra.Device.DESCRIPTOR.fields_by_name
    assert [(n, device[n].number) for n in device] == [
        ("request_names", 1),
        ("pool_name", 2),
        ("device_name", 3),
        ("cdi_device_ids", 4),
        ("share_id", 5),
    ]
    claim = dra.Claim.DESCRIPTOR.fields_by_name
    assert (claim["namespace"].number, claim["uid"].number, claim["name"].number) == (1, 2, 3)
    assert reg.DESCRIPTOR.package == "pluginregistration"
    info = reg.PluginInfo.DESCRIPTOR.fields_by_name
    assert [(n, info[n].number) for n in info] == [
        ("type", 1),
        ("name", 2),
        ("endpoint", 3),
        ("supported_versions", 4),
    ]
    assert DRA_SUPPORTED_VERSION == "v1.DRAPlugin"


def test_device_plugin_mode_is_the_default_and_dra_mode_is_chosen_by_its_setting() -> None:
    assert config.load(BASE).plugin_mode == config.DEVICE_PLUGIN
    s = config.load({**BASE, "TESSERA_PLUGIN_MODE": "dra", "TESSERA_KUBE_API_URL": "https://k"})
    assert s.plugin_mode == config.DRA
    assert s.dra_registry_dir == Path("/var/lib/kubelet/plugins_registry")
    assert s.dra_plugin_dir == Path("/var/lib/kubelet/plugins/gpu.tessera.io")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TESSERA_PLUGIN_MODE": "DRA"}, "is not a mode of the node plugin: use deviceplugin"),
        ({"TESSERA_PLUGIN_MODE": "extender"}, "is not a mode of the node plugin"),
        ({"TESSERA_PLUGIN_MODE": "dra"}, "needs the API server"),
        (
            {
                "TESSERA_PLUGIN_MODE": "dra",
                "TESSERA_KUBE_API_URL": "https://k",
                "TESSERA_DEVICE_MODE": "paths",
            },
            "CDI IDs only",
        ),
        (
            {
                "TESSERA_PLUGIN_MODE": "dra",
                "TESSERA_KUBE_API_URL": "https://k",
                "TESSERA_DRA_REGISTRY_DIR": "plugins_registry",
            },
            "must be an absolute path",
        ),
        (
            {
                "TESSERA_PLUGIN_MODE": "dra",
                "TESSERA_KUBE_API_URL": "https://k",
                "TESSERA_DRA_REGISTRY_DIR": "/var/lib/" + "k" * 80 + "/plugins_registry",
            },
            "a unix socket's path holds at most 107",
        ),
    ],
)
def test_a_bad_mode_setting_is_refused_naming_the_fix(env: dict[str, str], message: str) -> None:
    with pytest.raises(config.ConfigError, match=message):
        config.load({**BASE, **env})


def test_the_answer_gives_the_cdi_id_once_and_every_result_its_share() -> None:
    prepared = PreparedClaim(
        "u-1",
        "ml",
        "c",
        "claim-u-1",
        "tessera.io/gpu=claim-u-1",
        (
            ClaimDevice("gpu", NODE, "gpu-0", "s-0", "GPU-a", "shared", 4096, 30),
            ClaimDevice("gpu", NODE, "gpu-1", None, "GPU-b", "exclusive", 81920, 100),
        ),
    )
    answer = prepare_answer(prepared)
    assert not answer.error
    first, second = answer.devices
    assert (list(first.request_names), first.pool_name, first.device_name) == (
        ["gpu"],
        NODE,
        "gpu-0",
    )
    assert list(first.cdi_device_ids) == ["tessera.io/gpu=claim-u-1"]
    assert first.share_id == "s-0"
    assert list(second.cdi_device_ids) == [] and not second.HasField("share_id")


def test_the_answer_gives_each_requests_cdi_id_on_its_first_device() -> None:
    def device(request: str, name: str) -> ClaimDevice:
        return ClaimDevice(request, NODE, name, None, f"GPU-{name}", "shared", 1024, 0)

    prepared = PreparedClaim(
        "u-2",
        "ml",
        "c",
        "claim-u-2",
        "tessera.io/gpu=claim-u-2",
        (device("a", "gpu-0"), device("b/x", "gpu-1"), device("b/x", "gpu-2")),
    )
    answer = prepare_answer(prepared)
    assert [list(d.request_names) for d in answer.devices] == [["a"], ["b"], ["b"]]
    assert [list(d.cdi_device_ids) for d in answer.devices] == [
        ["tessera.io/gpu=claim-u-2-a"],
        ["tessera.io/gpu=claim-u-2-b"],
        [],
    ]
    assert container_cdi_ids(answer, "b") == ["tessera.io/gpu=claim-u-2-b"]
    assert container_cdi_ids(answer, "") == [
        "tessera.io/gpu=claim-u-2-a",
        "tessera.io/gpu=claim-u-2-b",
    ]


# -- the plugin process --------------------------------------------------------------------


@dataclass
class DraNode:
    root: Path
    gpu: GpuNode
    plane: FakeControlPlane
    api: FakeKubeApi
    kubelet: FakeDraKubelet
    plugin: PluginProcess
    dp_kubelet: FakeKubelet
    plugin_env: dict[str, str]

    @property
    def uuids(self) -> list[str]:
        return [c.uuid for c in self.gpu.cards]

    def restart_plugin(self) -> None:
        assert self.plugin.stop() == 0, self.plugin.text()
        self.plugin = PluginProcess(
            self.root, self.gpu, self.dp_kubelet, self.plane, "plugin-2.log", **self.plugin_env
        )


async def restarted(node: DraNode) -> None:
    """The plugin restarted and registered again under its new endpoint."""
    endpoint = node.kubelet.drivers[DRIVER].info.endpoint
    node.restart_plugin()
    await eventually(
        lambda: (
            DRIVER in node.kubelet.drivers
            and node.kubelet.drivers[DRIVER].info.endpoint != endpoint
        ),
        timeout=15,
        what="the new plugin registered",
    )


@contextlib.asynccontextmanager
async def dra_node(
    root: Path,
    n_cards: int = 2,
    modes: dict[int, str] | None = None,
    mig_capable: tuple[int, ...] = (),
    failing: tuple[tuple[int, str], ...] = (),
    **env: str,
) -> AsyncIterator[DraNode]:
    """``modes``: the control plane's card modes from the first inventory answer, by index;
    ``mig_capable``: the cards (by index) the fake NVML gives the A100 80GB's MIG geometry;
    ``failing``: (card index, NVML query) that fail from the start (``GpuNode.fail``)."""
    gpu = GpuNode(root, [replace(c, mig=i in mig_capable) for i, c in enumerate(cards(n_cards))])
    for index, call in failing:
        gpu.fail(gpu.cards[index].uuid, call)
    plane = FakeControlPlane()
    if modes:
        plane.modes = {gpu.cards[i].uuid: m for i, m in modes.items()}
    api = FakeKubeApi(KUBE_TOKEN)
    (root / "kube-token").write_text(KUBE_TOKEN + "\n")
    device_plugin_kubelet = FakeKubelet(root / "k")  # the PodResources socket
    await device_plugin_kubelet.start()
    kubelet = FakeDraKubelet(root / "k")
    await kubelet.start()
    plugin_env = {
        "TESSERA_PLUGIN_MODE": "dra",
        "TESSERA_KUBE_API_URL": api.url,
        "TESSERA_KUBE_TOKEN_FILE": str(root / "kube-token"),
        "TESSERA_DRA_REGISTRY_DIR": str(kubelet.registry_dir),
        "TESSERA_DRA_PLUGIN_DIR": str(kubelet.plugins_dir / DRIVER),
        **env,
    }
    plugin = PluginProcess(root, gpu, device_plugin_kubelet, plane, **plugin_env)
    node = DraNode(root, gpu, plane, api, kubelet, plugin, device_plugin_kubelet, plugin_env)
    try:
        try:
            await kubelet.wait_registered(DRIVER)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}:\n{plugin.text()}") from None
        yield node
    finally:
        rc = node.plugin.stop()
        await kubelet.stop()
        await device_plugin_kubelet.stop()
        api.stop()
        plane.stop()
        assert rc == 0, f"plugin exited {rc} on SIGTERM:\n{node.plugin.text()}"


def allocated_claim(
    uid: str, *results: tuple[str, str, str], name: str = "", pool: str = NODE
) -> dict[str, Any]:
    """A claim as kube-scheduler leaves it; ``results``: (device, memory, compute)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "ml", "name": name or f"claim-{uid}", "uid": uid},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": DRIVER,
                            "pool": pool,
                            "device": device,
                            "shareID": f"share-{uid}-{device}",
                            "consumedCapacity": {"memory": mem, "compute": cpu, "slots": "1"},
                        }
                        for device, mem, cpu in results
                    ]
                }
            },
            "reservedFor": [{"resource": "pods", "name": "train", "uid": f"pod-{uid}"}],
        },
    }


def ref(claim: dict[str, Any]) -> tuple[str, str, str]:
    meta = claim["metadata"]
    return (meta["namespace"], meta["name"], meta["uid"])


def spec_of(node: DraNode, uid: str) -> dict[str, Any]:
    path = node.plugin.cdi_dir / f"tessera.io_gpu-claim-{uid}.json"
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def checkpoint(node: DraNode) -> dict[str, Any]:
    path = node.plugin.state_dir / "dra" / "claims.json"
    if not path.exists():
        return {}
    claims: dict[str, Any] = json.loads(path.read_text())["claims"]
    return claims


def env_of(spec: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in spec["devices"][0]["containerEdits"].get("env", []):
        k, _, v = e.partition("=")
        out[k] = v
    return out


def test_registers_publishes_prepares_and_unprepares_a_claim(short_tmp: Path) -> None:
    async def body() -> None:
        async with dra_node(short_tmp) as node:
            info = node.kubelet.infos[-1]
            assert (info.type, info.name) == ("DRAPlugin", DRIVER)
            assert list(info.supported_versions) == ["v1.DRAPlugin"]
            assert Path(info.endpoint).parent == node.kubelet.plugins_dir / DRIVER
            await eventually(lambda: f"{NODE}-{DRIVER}" in node.api.slices, what="the slice")
            published = node.api.slices[f"{NODE}-{DRIVER}"]["spec"]
            assert (published["nodeName"], published["pool"]["name"]) == (NODE, NODE)
            names = [d["name"] for d in published["devices"]]
            assert names == ["gpu-0", "gpu-1"]
            assert all(d["allowMultipleAllocations"] for d in published["devices"])
            # the driver's and CUDA's versions, from NVML (the fake's 550.54.15 and 12040)
            attrs = published["devices"][0]["attributes"]
            assert attrs["driverVersion"] == {"version": "550.54.15"}
            assert attrs["cudaVersion"] == {"version": "12.4.0"}

            c = allocated_claim("u-1", ("gpu-1", "4Gi", "30"))
            node.api.add_claim(c)
            answers = await node.kubelet.prepare(DRIVER, ref(c))
            answer = answers["u-1"]
            assert not answer.error, answer.error
            (device,) = answer.devices
            assert (device.pool_name, device.device_name) == (NODE, "gpu-1")
            assert list(device.cdi_device_ids) == ["tessera.io/gpu=claim-u-1"]
            assert device.share_id == "share-u-1-gpu-1"
            env = env_of(spec_of(node, "u-1"))
            assert env["NVIDIA_VISIBLE_DEVICES"] == node.uuids[1], env
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "4096", env
            assert env["TESSERA_DEVICE_CORE_LIMIT_0"] == "30", env
            assert set(checkpoint(node)) == {"u-1"}

            # The kubelet repeats itself: the same answer, one entry, the spec untouched.
            spec_file = node.plugin.cdi_dir / "tessera.io_gpu-claim-u-1.json"
            mtime = spec_file.stat().st_mtime_ns
            again = (await node.kubelet.prepare(DRIVER, ref(c)))["u-1"]
            assert again == answer and spec_file.stat().st_mtime_ns == mtime
            assert set(checkpoint(node)) == {"u-1"}

            gone = (await node.kubelet.unprepare(DRIVER, ref(c)))["u-1"]
            assert not gone.error
            assert not spec_file.exists() and checkpoint(node) == {}
            # An unknown claim is already unprepared.
            assert not (await node.kubelet.unprepare(DRIVER, ref(c)))["u-1"].error

    run(body)


def test_a_claim_the_plugin_must_not_prepare_gets_an_error_and_nothing_on_disk(
    short_tmp: Path,
) -> None:
    async def body() -> None:
        async with dra_node(short_tmp) as node:
            other_node = allocated_claim("u-2", ("gpu-0", "4Gi", "30"), pool="gpu-node-9")
            too_big = allocated_claim("u-3", ("gpu-0", "81921Mi", "30"))
            no_device = allocated_claim("u-4", ("gpu-7", "4Gi", "30"))
            for c in (other_node, too_big, no_device):
                node.api.add_claim(c)
            replaced = allocated_claim("u-5", ("gpu-0", "4Gi", "30"))
            node.api.add_claim({**replaced, "metadata": {**replaced["metadata"], "uid": "u-6"}})
            answers = await node.kubelet.prepare(
                DRIVER,
                ref(other_node),
                ref(too_big),
                ref(no_device),
                ref(replaced),
                ("ml", "missing", "u-7"),
            )
            assert "not this node's" in answers["u-2"].error
            assert "81921 MiB" in answers["u-3"].error
            assert "publishes no such device" in answers["u-4"].error
            assert "was replaced" in answers["u-5"].error
            assert "not found" in answers["u-7"].error
            assert all(not a.devices for a in answers.values())
            assert checkpoint(node) == {}
            assert list(node.plugin.cdi_dir.glob("*claim-*")) == []

    run(body)


def test_a_restarted_plugin_keeps_every_claim_prepared_once(short_tmp: Path) -> None:
    async def body() -> None:
        async with dra_node(short_tmp) as node:
            claims = [allocated_claim(f"u-{i}", (f"gpu-{i % 2}", "8Gi", "25")) for i in range(3)]
            for c in claims:
                node.api.add_claim(c)
            first = await node.kubelet.prepare(DRIVER, *(ref(c) for c in claims))
            assert all(not a.error for a in first.values()), first

            await restarted(node)
            # Answered from the checkpoint: the claim is not even read again.
            node.api.remove_claim("ml", "claim-u-0")
            again = await node.kubelet.prepare(DRIVER, *(ref(c) for c in claims))
            assert again == first
            assert set(checkpoint(node)) == {"u-0", "u-1", "u-2"}
            # The claim was deleted; unprepare after the restart still removes its spec.
            assert not (await node.kubelet.unprepare(DRIVER, ref(claims[0])))["u-0"].error
            assert set(checkpoint(node)) == {"u-1", "u-2"}
            assert not (node.plugin.cdi_dir / "tessera.io_gpu-claim-u-0.json").exists()
            assert (node.plugin.cdi_dir / "tessera.io_gpu-claim-u-1.json").exists()

    run(body)


def test_a_restarted_kubelet_registers_the_plugin_again(short_tmp: Path) -> None:
    async def body() -> None:
        async with dra_node(short_tmp) as node:
            c = allocated_claim("u-1", ("gpu-0", "2Gi", "10"))
            node.api.add_claim(c)
            assert not (await node.kubelet.prepare(DRIVER, ref(c)))["u-1"].error
            registered = len(node.kubelet.infos)
            await node.kubelet.restart()
            await node.kubelet.wait_registered(DRIVER)
            assert len(node.kubelet.infos) == registered + 1
            assert not (await node.kubelet.prepare(DRIVER, ref(c)))["u-1"].error
            assert set(checkpoint(node)) == {"u-1"}
            # A registration socket removed by hand is put back, and the kubelet takes it.
            reg_socket = node.kubelet.registry_dir / f"{DRIVER}-reg.sock"
            reg_socket.unlink()
            await eventually(reg_socket.is_socket, what="the registration socket put back")
            await eventually(
                lambda: len(node.kubelet.infos) == registered + 2, what="registered again"
            )
            await node.kubelet.wait_registered(DRIVER)
            assert not (await node.kubelet.prepare(DRIVER, ref(c)))["u-1"].error

    run(body)


def test_slices_follow_health_and_card_modes_and_come_back_when_deleted(short_tmp: Path) -> None:
    async def body() -> None:
        name = f"{NODE}-{DRIVER}"
        async with dra_node(short_tmp) as node:

            def spec() -> dict[str, Any]:
                with node.api.lock:
                    s = node.api.slices.get(name)
                    return json.loads(json.dumps(s["spec"])) if s else {}

            await eventually(lambda: bool(spec()), what="the slice")
            generation = spec()["pool"]["generation"]
            node.gpu.lose(node.uuids[0])
            await eventually(lambda: "taints" in spec().get("devices", [{}])[0], what="the taint")
            taint = spec()["devices"][0]["taints"]
            assert taint == [{"key": UNHEALTHY_TAINT, "effect": "NoSchedule"}]
            assert spec()["pool"]["generation"] > generation

            node.plane.modes = {node.uuids[1]: "exclusive"}
            await eventually(
                lambda: "allowMultipleAllocations" not in spec()["devices"][1],
                timeout=10,
                what="card 1 exclusive",
            )
            assert spec()["devices"][1]["attributes"]["mode"] == {"string": "exclusive"}

            with node.api.lock:
                del node.api.slices[name]  # the kubelet's wipe, or an operator
            await eventually(lambda: bool(spec()), timeout=10, what="the slice put back")
            # An unchanged node writes nothing on its resync.
            writes = node.api.slice_writes()
            await eventually(lambda: len(node.plane.reports) >= 3, timeout=10, what="heartbeats")
            assert node.api.slice_writes() == writes

    run(body)


def test_slices_wait_for_the_control_planes_card_modes(short_tmp: Path) -> None:
    """A card the control plane has exclusive is never offered as shared, not even before the
    plugin's first inventory answer."""

    async def body() -> None:
        async with dra_node(short_tmp, modes={1: "exclusive"}) as node:
            name = f"{NODE}-{DRIVER}"
            await eventually(lambda: name in node.api.slices, timeout=10, what="the slice")
            with node.api.lock:
                created = [p for m, p in node.api.requests if m == "POST"]
                spec = json.loads(json.dumps(node.api.slices[name]["spec"]))
            assert len(created) == 1 and spec["pool"]["generation"] == 1
            assert spec["devices"][1]["attributes"]["mode"] == {"string": "exclusive"}
            assert "allowMultipleAllocations" not in spec["devices"][1]

    run(body)


def test_a_mig_card_offers_every_placement_nvml_gives_consuming_its_memory_slices(
    short_tmp: Path,
) -> None:
    """A card the control plane has in MIG mode: the plugin turns MIG on and publishes one
    device per profile placement NVML lists (the fake's A100 80GB: 25), each consuming the
    counters of the memory slices it covers, beside the counter set in a slice of its own."""

    async def body() -> None:
        async with dra_node(short_tmp, modes={1: "mig"}, mig_capable=(1,)) as node:
            counters = f"{NODE}-{DRIVER}-counters"
            await eventually(lambda: counters in node.api.slices, timeout=10, what="counters")
            with node.api.lock:
                devices = json.loads(json.dumps(node.api.slices[f"{NODE}-{DRIVER}"]["spec"]))
                sets = json.loads(json.dumps(node.api.slices[counters]["spec"]))
            assert devices["pool"]["resourceSliceCount"] == sets["pool"]["resourceSliceCount"] == 2
            assert devices["pool"]["generation"] == sets["pool"]["generation"]
            (card_set,) = sets["sharedCounters"]
            assert card_set["name"] == "gpu-1-slices"
            assert card_set["counters"] == {f"memory-slice-{k}": {"value": "1"} for k in range(8)}
            by_name = {d["name"]: d for d in devices["devices"]}
            assert by_name["gpu-0"]["allowMultipleAllocations"] is True  # the shared card
            mig = {n: d for n, d in by_name.items() if n.startswith("gpu-1-")}
            assert "gpu-1" not in by_name
            placements = {
                (d["attributes"]["profile"]["string"], d["attributes"]["placementStart"]["int"])
                for d in mig.values()
            }
            assert placements == {
                *(("1g.10gb", s) for s in range(7)),
                *(("1g.10gb+me", s) for s in range(7)),
                *(("1g.20gb", s) for s in (0, 2, 4, 6)),
                *(("2g.20gb", s) for s in (0, 2, 4)),
                ("3g.40gb", 0),
                ("3g.40gb", 4),
                ("4g.40gb", 0),
                ("7g.80gb", 0),
            }
            three = mig["gpu-1-mig-3g-40gb-4"]
            assert three["capacity"] == {"memory": {"value": "40192Mi"}}
            assert three["attributes"]["mode"] == {"string": "mig"}
            assert three["attributes"]["uuid"] == {"string": node.uuids[1]}
            assert three["attributes"]["placementSize"] == {"int": 4}
            assert three["consumesCounters"] == [
                {
                    "counterSet": "gpu-1-slices",
                    "counters": {f"memory-slice-{k}": {"value": "1"} for k in (4, 5, 6, 7)},
                }
            ]
            assert "allowMultipleAllocations" not in three
            whole = mig["gpu-1-mig-7g-80gb-0"]["consumesCounters"][0]["counters"]
            assert set(whole) == {f"memory-slice-{k}" for k in range(8)}

    run(body)


def test_a_mig_claim_gets_its_instance_at_prepare_once_and_loses_it_at_unprepare(
    short_tmp: Path,
) -> None:
    """A claim allocated a MIG placement: prepare creates the GPU and compute instance there
    and the spec names that MIG device; a repeat, a lost spec and a restart never make a
    second one; a claim whose placement overlaps it is refused with nothing created; unprepare
    (after a restart, the claim gone) destroys it."""

    async def body() -> None:
        async with dra_node(
            short_tmp,
            modes={1: "mig"},
            mig_capable=(1,),
            TESSERA_PROC_ROOT=str(short_tmp / "proc"),  # the fake driver's nvidia-caps table
        ) as node:
            gpu, card = node.gpu, node.uuids[1]
            counters = f"{NODE}-{DRIVER}-counters"
            await eventually(lambda: counters in node.api.slices, timeout=10, what="counters")
            c = allocated_claim("m-1", ("gpu-1-mig-3g-40gb-4", "40192Mi", "0"))
            node.api.add_claim(c)
            answer = (await node.kubelet.prepare(DRIVER, ref(c)))["m-1"]
            assert not answer.error, answer.error
            assert [d.device_name for d in answer.devices] == ["gpu-1-mig-3g-40gb-4"]
            made = gpu.mig_state(card)
            assert [g[2:] for g in made["gi"]] == [(4, 4)] and len(made["ci"]) == 1
            (entry,) = checkpoint(node)["m-1"]["devices"]
            assert entry["mig_uuid"].startswith("MIG-") and entry["mig_gi"] == made["gi"][0][0]
            spec = spec_of(node, "m-1")
            assert env_of(spec)["NVIDIA_VISIBLE_DEVICES"] == entry["mig_uuid"]
            assert "TESSERA_DEVICE_MEMORY_LIMIT_0" not in env_of(spec)  # MIG holds itself
            paths = {d["path"] for d in spec["devices"][0]["containerEdits"]["deviceNodes"]}
            assert f"/dev/nvidia-caps/nvidia-cap{gpu.mig_minor(1, entry['mig_gi'])}" in paths
            ci_minor = gpu.mig_minor(1, entry["mig_gi"], entry["mig_ci"])
            assert f"/dev/nvidia-caps/nvidia-cap{ci_minor}" in paths

            # A placement overlapping the instance: refused, nothing created or written.
            o = allocated_claim("m-2", ("gpu-1-mig-1g-10gb-5", "9728Mi", "0"))
            node.api.add_claim(o)
            refused = (await node.kubelet.prepare(DRIVER, ref(o)))["m-2"].error
            assert "1g.10gb at placement start=5 size=1 is taken" in refused, refused
            assert "3g.40gb instance at start=4 size=4" in refused, refused
            assert gpu.mig_state(card) == made and set(checkpoint(node)) == {"m-1"}
            assert not (node.plugin.cdi_dir / "tessera.io_gpu-claim-m-2.json").exists()

            # A repeat, and a prepare whose spec is gone: the same instance adopted.
            assert (await node.kubelet.prepare(DRIVER, ref(c)))["m-1"] == answer
            (node.plugin.cdi_dir / "tessera.io_gpu-claim-m-1.json").unlink()
            assert (await node.kubelet.prepare(DRIVER, ref(c)))["m-1"] == answer
            assert gpu.mig_state(card) == made and spec_of(node, "m-1") == spec

            await restarted(node)
            assert (await node.kubelet.prepare(DRIVER, ref(c)))["m-1"] == answer
            assert gpu.mig_state(card) == made
            node.api.remove_claim("ml", "claim-m-1")
            assert not (await node.kubelet.unprepare(DRIVER, ref(c)))["m-1"].error
            gone = gpu.mig_state(card)
            assert (gone["gi"], gone["ci"]) == ([], []), gone
            assert checkpoint(node) == {}
            assert not (node.plugin.cdi_dir / "tessera.io_gpu-claim-m-1.json").exists()
            assert not list((node.plugin.state_dir / "mig").glob("*.json"))

    run(body)


def test_a_container_naming_one_request_of_a_claim_gets_that_requests_devices_only(
    short_tmp: Path,
) -> None:
    """A claim of two requests: one spec per request, each with its own devices and limits from
    ordinal 0, so a container naming only the later request gets its card and nothing of the
    first; a prioritized list's subrequest counts as its request; unprepare removes both."""

    async def body() -> None:
        async with dra_node(short_tmp) as node:
            await eventually(lambda: f"{NODE}-{DRIVER}" in node.api.slices, what="the slice")
            c = allocated_claim("r-1", ("gpu-0", "2Gi", "10"), ("gpu-1", "8Gi", "40"))
            results = c["status"]["allocation"]["devices"]["results"]
            results[0]["request"], results[1]["request"] = "small", "big/a100"
            node.api.add_claim(c)
            answer = (await node.kubelet.prepare(DRIVER, ref(c)))["r-1"]
            assert not answer.error, answer.error
            assert [list(d.request_names) for d in answer.devices] == [["small"], ["big"]]
            big = container_cdi_ids(answer, "big")
            small = container_cdi_ids(answer, "small")
            assert big == ["tessera.io/gpu=claim-r-1-big"], big
            assert small == ["tessera.io/gpu=claim-r-1-small"], small

            def env_for(cdi_id: str) -> dict[str, str]:
                return env_of(spec_of(node, "r-1-" + cdi_id.rpartition("-")[2]))

            env = env_for(big[0])
            assert env["NVIDIA_VISIBLE_DEVICES"] == node.uuids[1], env
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "8192", env
            assert env["TESSERA_DEVICE_CORE_LIMIT_0"] == "40", env
            assert "TESSERA_DEVICE_MEMORY_LIMIT_1" not in env
            env = env_for(small[0])
            assert env["NVIDIA_VISIBLE_DEVICES"] == node.uuids[0], env
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "2048", env
            assert not (node.plugin.cdi_dir / "tessera.io_gpu-claim-r-1.json").exists()
            assert set(checkpoint(node)) == {"r-1"}

            # One request's spec lost: the repeat writes it again, the answer unchanged.
            (node.plugin.cdi_dir / "tessera.io_gpu-claim-r-1-big.json").unlink()
            assert (await node.kubelet.prepare(DRIVER, ref(c)))["r-1"] == answer
            assert env_of(spec_of(node, "r-1-big"))["NVIDIA_VISIBLE_DEVICES"] == node.uuids[1]

            assert not (await node.kubelet.unprepare(DRIVER, ref(c)))["r-1"].error
            assert not list(node.plugin.cdi_dir.glob("tessera.io_gpu-claim-r-1*"))
            assert checkpoint(node) == {}

    run(body)


def test_a_mig_card_whose_placements_nvml_cannot_give_yet_is_asked_again(short_tmp: Path) -> None:
    """NVML failing to list a MIG card's placements: the card offers nothing while the other
    card is published, and once NVML answers its placements come within a few heartbeats,
    with no change of the card modes to prompt them."""

    async def body() -> None:
        async with dra_node(
            short_tmp, modes={1: "mig"}, mig_capable=(1,), failing=((1, "placements"),)
        ) as node:
            name, counters = f"{NODE}-{DRIVER}", f"{NODE}-{DRIVER}-counters"
            await eventually(lambda: name in node.api.slices, timeout=10, what="the slice")
            await eventually(
                lambda: node.gpu.mig_state(node.uuids[1])["mode"] == (1, 1), what="MIG on"
            )
            with node.api.lock:
                devices = [d["name"] for d in node.api.slices[name]["spec"]["devices"]]
            assert devices == ["gpu-0"] and counters not in node.api.slices
            node.gpu.fail(node.uuids[1], "placements", on=False)
            await eventually(lambda: counters in node.api.slices, timeout=10, what="counters")
            with node.api.lock:
                devices = [d["name"] for d in node.api.slices[name]["spec"]["devices"]]
            assert "gpu-1-mig-7g-80gb-0" in devices and len(devices) == 26

    run(body)
