"""The node plugin end to end: a real ``python -m nodeplugin`` process, real pynvml against the
fake libnvidia-ml.so.1, the kubelet's gRPC APIs over unix sockets, a control plane on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from e2e.ports import free_port
from nodeplugin.app import STOPPING, UNREGISTERED
from nodeplugin.pb import dp
from tests.nodeplugin.conftest import eventually, fake_node, run
from tests.nodeplugin.harness.kubelet import Container, Pod
from tests.nodeplugin.harness.plugin import NODE, TOKEN, PluginProcess
from tests.nodeplugin.helpers import (
    bind_pod,
    cdi_name,
    cdi_spec,
    expected_env,
    region_bytes,
    scrape_when,
    spec_env,
    spec_nodes,
)


def test_registers_serves_and_reports_inventory(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k = node.kubelet
            ((_, req),) = k.registrations
            assert req.version == "v1beta1"
            # A socket of this process's own, under the plugin's well-known name too.
            assert req.endpoint.startswith(".tessera-gpu.sock.")
            public, private = k.plugin_dir / "tessera-gpu.sock", k.plugin_dir / req.endpoint
            assert public.stat().st_ino == private.stat().st_ino
            assert req.resource_name == "nvidia.com/gpu"
            assert req.options.pre_start_required and req.options.get_preferred_allocation_available
            assert k.options is not None and k.options.pre_start_required
            # 4 cards x 4 slots, all healthy, NUMA from NVML
            assert len(k.health) == 16
            assert set(k.health.values()) == {"Healthy"}
            for c in node.gpu.cards:
                for s in range(4):
                    assert k.topology[f"{c.uuid}::{s}"] == [c.numa]
            await eventually(lambda: bool(node.plane.reports), what="an inventory report")
            _, name, body = node.plane.reports[0]
            assert name == NODE
            assert body["plugin_version"] == "0.1.0"
            assert body["cards"] == [
                {
                    "uuid": c.uuid,
                    "index": i,
                    "model": c.name,
                    "memory_mib": c.memory_mib,
                    "numa_node": c.numa,
                    "healthy": True,
                    "health_reason": "",
                }
                for i, c in enumerate(node.gpu.cards)
            ]
            # heartbeat: it keeps reporting (TESSERA_HEARTBEAT_S=1)
            await eventually(lambda: len(node.plane.reports) >= 2, timeout=3, what="heartbeat")
            assert node.plugin.alive()
        assert not (node.kubelet.plugin_dir / "tessera-gpu.sock").exists(), "socket left behind"
        assert "stopped" in node.plugin.text()

    run(main)


def test_kubelet_restart_reregisters_within_two_seconds(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k = node.kubelet
            t0 = time.monotonic()
            await k.restart()
            await k.wait_registered(count=2, timeout=2.0)
            assert k.registrations[1][0] - t0 < 2.0
            assert (k.plugin_dir / "tessera-gpu.sock").exists(), "plugin did not serve again"
            # and it works after the restart
            pod, _ = bind_pod(
                node.plane, "after-restart", [("app", False, [(node.uuids[2], 2048, 30)])]
            )
            await k.admit(pod)
            await k.start_container(pod, "app")
            env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app")))
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "2048"
            # twice more, quickly
            for n in (3, 4):
                await k.restart()
                await k.wait_registered(count=n, timeout=2.0)

    run(main)


def test_health_flip_and_recovery_in_list_and_watch(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k, gpu = node.kubelet, node.gpu
            bad = node.uuids[1]
            bad_ids = {f"{bad}::{s}" for s in range(4)}

            def sick(snap: dict[str, str]) -> bool:
                return all(snap[i] == "Unhealthy" for i in bad_ids) and all(
                    h == "Healthy" for i, h in snap.items() if i not in bad_ids
                )

            # an application XID (13) is not a card fault
            gpu.xid(bad, 13)
            await asyncio.sleep(0.5)
            assert set(k.health.values()) == {"Healthy"}
            # a critical XID: out at once, back after the quiet period (0.5 s) with probes passing
            t0 = time.monotonic()
            gpu.xid(bad, 79)
            t_sick = await k.wait_update(sick, timeout=2)
            assert t_sick - t0 < 1.0
            await eventually(
                lambda: any(
                    not c["healthy"] and c["health_reason"] == "XID 79"
                    for _, _, r in node.plane.reports
                    for c in r["cards"]
                ),
                what="unhealthy card in the inventory report",
            )
            # Allocate on a sick card is refused
            with pytest.raises(grpc.aio.AioRpcError) as err:
                assert k.client is not None
                await k.client.Allocate(
                    dp.AllocateRequest(
                        container_requests=[dp.ContainerAllocateRequest(devices_ids=[f"{bad}::0"])]
                    )
                )
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "unhealthy" in (err.value.details() or "")
            n = len(k.updates)
            await k.wait_update(
                lambda s: set(s.values()) == {"Healthy"} and len(k.updates) > n, timeout=3
            )
            # a lost card (probes fail) goes and comes back
            gpu.lose(node.uuids[3])
            await k.wait_update(lambda s: s[f"{node.uuids[3]}::0"] == "Unhealthy", timeout=2)
            gpu.recover(node.uuids[3])
            await k.wait_update(
                lambda s: s[f"{node.uuids[3]}::0"] == "Healthy" and len(k.updates) > n + 2,
                timeout=3,
            )
            assert set(k.health.values()) == {"Healthy"}

    run(main)


def test_twenty_pods_in_shuffled_order_get_exactly_their_cards(short_tmp: Path) -> None:
    rng = random.Random(4)

    async def main() -> None:
        async with fake_node(short_tmp, TESSERA_SLOTS="10") as node:
            k, plane = node.kubelet, node.plane
            load = dict.fromkeys(node.uuids, 0)
            pods: list[tuple[Pod, dict[str, list[tuple[str, int, int]]]]] = []
            for i in range(20):
                count = 2 if i % 4 == 0 else 1
                containers = []
                for cname in ["app", "sidecar"] if i % 5 == 0 else ["app"]:
                    free = [u for u in node.uuids if load[u] < 10]
                    cards_ = rng.sample(free, count)
                    for u in cards_:
                        load[u] += 1
                    containers.append(
                        (
                            cname,
                            False,
                            [
                                (u, 1000 + 37 * i + 5 * j, (i * 7 + j) % 101)
                                for j, u in enumerate(cards_)
                            ],
                        )
                    )
                pod, _ = bind_pod(plane, f"trainer-{i}", containers)
                pods.append((pod, {c: s for c, _, s in containers}))
            order = list(range(20))
            rng.shuffle(order)
            for i in order:  # the kubelet admits pods one at a time
                await k.admit(pods[i][0])
            starts = [(p, c) for p, want in pods for c in want]
            rng.shuffle(starts)
            await asyncio.gather(*(k.start_container(p, c) for p, c in starts))
            names = set()
            minor = {c.uuid: c.minor for c in node.gpu.cards}
            for pod, want in pods:
                for cname, slices in want.items():
                    qualified = cdi_name(pod, cname)
                    names.add(qualified)
                    spec = cdi_spec(node.plugin.cdi_dir, qualified)
                    env = spec_env(spec)
                    for key, value in expected_env(slices).items():
                        assert env[key] == value, (pod.name, cname, key)
                    assert not any(
                        k_.startswith("TESSERA_DEVICE_MEMORY_LIMIT_")
                        and int(k_.rsplit("_", 1)[1]) >= len(slices)
                        for k_ in env
                    )
                    nodes = spec_nodes(spec)
                    assert nodes[: len(slices)] == [f"/dev/nvidia{minor[u]}" for u, _, _ in slices]
                    assert not any(
                        n.startswith("/dev/nvidia") and n[11:].isdigit()
                        for n in nodes[len(slices) :]
                    )
                    held = {i.split("::")[0] for i in pod.devices[cname]}
                    assert held == {u for u, _, _ in slices}
            assert len(names) == sum(len(w) for _, w in pods), "a CDI name was reused"
            recorded = {(uid, c): devs for uid, c, devs in plane.allocated}
            assert len(recorded) == len(names)
            for pod, want in pods:
                uid = json.loads(plane.allocations[(pod.namespace, pod.name)])["pod_uid"]
                for cname, slices in want.items():
                    assert recorded[(uid, cname)] == [u for u, _, _ in slices]
            # the same container restarting gets the same config again
            pod0, want0 = pods[0]
            await k.start_container(pod0, "app")
            env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod0, "app")))
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == str(want0["app"][0][1])

    run(main)


def test_forged_annotations_get_nothing_extra(short_tmp: Path) -> None:
    """Only the ledger (or a record the control plane signed) counts, never a pod's own
    annotations."""
    key = b"k" * 32

    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k, plane = node.kubelet, node.plane
            pod, raw = bind_pod(plane, "honest", [("app", False, [(node.uuids[0], 1024, 10)])])
            # the pod's owner edits the annotation to claim a whole card
            forged = raw.replace('"memory_mib":1024', '"memory_mib":81920').replace(
                '"cores":10', '"cores":100'
            )
            plane.pods[("team-a", "honest")].annotations["tessera.io/allocation"] = forged
            await k.admit(pod)
            await k.start_container(pod, "app")
            env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app")))
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "1024"
            assert env["TESSERA_DEVICE_CORE_LIMIT_0"] == "10"

    async def annotation_mode() -> None:
        root = short_tmp / "ann2"
        from tests.nodeplugin.harness.controlplane import FakeControlPlane

        api = FakeControlPlane()  # plays the API server for pod GETs
        api.add_token(TOKEN, NODE)
        try:
            async with fake_node(
                root,
                TESSERA_ALLOCATION_SOURCE="annotation",
                TESSERA_ALLOCATION_KEY_FILE=str(_write(root.parent / "key", key)),
                TESSERA_KUBE_API_URL=api.url,
                TESSERA_KUBE_TOKEN_FILE=str(_write(root.parent / "kube-token", TOKEN.encode())),
            ) as node:
                k = node.kubelet
                u = node.uuids
                # signed by the control plane: accepted
                good, raw = bind_pod(api, "signed", [("app", False, [(u[0], 2048, 20)])], key=key)
                node.plane.bind(raw, annotations=False)  # the ledger agrees
                await k.admit(good)
                await k.start_container(good, "app")
                env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(good, "app")))
                assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "2048"
                assert [c for _, c, _ in node.plane.allocated] == ["app"]
                # a signed record the ledger no longer has (released) or disagrees with: refused
                for case, ledger_card in (("released", None), ("moved", u[2])):
                    pod, raw = bind_pod(api, case, [("app", False, [(u[1], 500, 0)])], key=key)
                    if ledger_card is not None:
                        node.plane.bind(raw.replace(u[1], ledger_card), annotations=False)
                    await k.admit(pod)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await k.start_container(pod, "app")
                    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert ("404" if ledger_card is None else "409") in (err.value.details() or "")
                    name = cdi_name(pod, "app").partition("=")[2]
                    assert not list(node.plugin.cdi_dir.glob(f"*{name}*"))
                    k.remove(pod)
                # forged: the owner wrote the annotation (no or wrong signature)
                for i, signer in enumerate((None, b"x" * 32)):
                    bad, _ = bind_pod(
                        api, f"forged-{i}", [("app", False, [(u[1], 81920, 100)])], key=signer
                    )
                    await k.admit(bad)
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await k.start_container(bad, "app")
                    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                    assert "not signed by the control plane" in (err.value.details() or "")
                    name = cdi_name(bad, "app").partition("=")[2]
                    assert not list(node.plugin.cdi_dir.glob(f"*{name}*"))
                    k.remove(bad)
                # a valid record copied from another pod (replay) is for another pod
                bind_pod(api, "victim", [("app", False, [(u[2], 4096, 0)])], key=key)
                thief, _ = bind_pod(api, "thief", [("app", False, [(u[2], 1, 0)])], key=key)
                api.pods[("team-a", "thief")].annotations = dict(
                    api.pods[("team-a", "victim")].annotations
                )
                await k.admit(thief)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await k.start_container(thief, "app")
                assert "is for pod team-a/victim" in (err.value.details() or "")
                assert node.plugin.alive()
        finally:
            api.stop()

    run(annotation_mode)
    run(main)


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_controlplane_down_refuses_clearly_then_recovers(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k, plane = node.kubelet, node.plane
            pod, _ = bind_pod(plane, "patient", [("app", False, [(node.uuids[3], 3000, 50)])])
            await k.admit(pod)
            plane.stop()  # connection refused
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await k.start_container(pod, "app")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "cannot reach the server" in (err.value.details() or "")
            assert time.monotonic() - t0 < 5  # gave up within TESSERA_PRESTART_TIMEOUT_S (3 s)
            assert not list(node.plugin.cdi_dir.glob("*.json")), "wrote a spec without a record"
            # 5xx is the same: refuse, write nothing
            plane.start()
            plane.status_override = 503
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await k.start_container(pod, "app")
            assert "server error 503" in (err.value.details() or "")
            assert not list(node.plugin.cdi_dir.glob("*.json"))

            # back while the kubelet's next try is waiting: the retry inside the call succeeds
            async def heal() -> None:
                await asyncio.sleep(0.7)
                plane.status_override = None

            await asyncio.gather(k.start_container(pod, "app"), heal())
            env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app")))
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "3000"
            assert "retrying" in node.plugin.text()
            assert node.plugin.alive()

    run(main)


def test_bad_input_is_refused_and_the_plugin_keeps_serving(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k, plane = node.kubelet, node.plane
            assert k.client is not None
            u = node.uuids

            async def refused(coro: object, code: grpc.StatusCode, text: str) -> None:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await coro  # type: ignore[misc]
                assert err.value.code() == code, err.value
                assert text in (err.value.details() or ""), err.value.details()

            # unknown device IDs
            await refused(
                k.client.Allocate(
                    dp.AllocateRequest(
                        container_requests=[
                            dp.ContainerAllocateRequest(devices_ids=["GPU-nope::0"])
                        ]
                    )
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "unknown device ID 'GPU-nope::0'",
            )
            await refused(
                k.client.Allocate(
                    dp.AllocateRequest(
                        container_requests=[
                            dp.ContainerAllocateRequest(devices_ids=[f"{u[0]}::99"])
                        ]
                    )
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "unknown device ID",
            )
            await refused(
                k.client.PreStartContainer(
                    dp.PreStartContainerRequest(devices_ids=[f"{u[0]}::0", f"{u[0]}::0"])
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                "named twice",
            )
            # IDs nobody holds
            await refused(
                k.client.PreStartContainer(dp.PreStartContainerRequest(devices_ids=[f"{u[0]}::1"])),
                grpc.StatusCode.FAILED_PRECONDITION,
                "no container the kubelet lists holds",
            )
            # a pod the control plane never allocated
            stray = Pod("team-b", "stray", [Container("app", 1)])
            await k.admit(stray)
            await refused(
                k.start_container(stray, "app"),
                grpc.StatusCode.FAILED_PRECONDITION,
                "no active allocation for pod team-b/stray",
            )
            k.remove(stray)
            # a malformed record
            pod, raw = bind_pod(plane, "malformed", [("app", False, [(u[1], 100, 5)])])
            plane.allocations[("team-a", "malformed")] = raw.replace(
                '"memory_mib":100', '"memory_mib":"lots"'
            )
            await k.admit(pod)
            await refused(
                k.start_container(pod, "app"),
                grpc.StatusCode.FAILED_PRECONDITION,
                "containers[0].devices[0].memory_mib must be an integer",
            )
            k.remove(pod)
            # a record for another node
            pod, raw = bind_pod(
                plane, "elsewhere", [("app", False, [(u[1], 100, 5)])], node="gpu-node-2"
            )
            await k.admit(pod)
            await refused(k.start_container(pod, "app"), grpc.StatusCode.FAILED_PRECONDITION, "403")
            k.remove(pod)
            # the kubelet put the container on other cards than the ledger (no preference)
            pod, _ = bind_pod(plane, "mismatch", [("app", False, [(u[2], 100, 5)])])
            k.honor_preferred = False
            pod.devices["app"] = [f"{u[3]}::0"]
            k.pods[("team-a", "mismatch")] = pod
            await refused(
                k.client.PreStartContainer(dp.PreStartContainerRequest(devices_ids=[f"{u[3]}::0"])),
                grpc.StatusCode.FAILED_PRECONDITION,
                "refusing rather than giving the wrong card",
            )
            k.remove(pod)
            k.honor_preferred = True
            assert not list(node.plugin.cdi_dir.glob("*.json")), "a refused start wrote a spec"
            # PodResources rate-limits: retried within the budget
            ok, _ = bind_pod(plane, "ok", [("app", False, [(u[0], 512, 0)])])
            await k.admit(ok)
            k.podres_exhausted = 3
            await k.start_container(ok, "app")
            assert k.podres_exhausted == 0
            # still serving
            opts = await k.client.GetDevicePluginOptions(dp.Empty())
            assert opts.pre_start_required
            assert node.plugin.alive()
            log = node.plugin.text()
            assert "PreStartContainer" in log and "refused" in log

    run(main)


def test_init_containers_get_their_own_limits(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k, plane = node.kubelet, node.plane
            u = node.uuids
            pod, _ = bind_pod(
                plane,
                "with-init",
                [
                    ("warmup", True, [(u[1], 500, 10)]),
                    ("app", False, [(u[1], 7000, 60)]),
                ],
            )
            await k.admit(pod)
            assert pod.devices["warmup"] == pod.devices["app"]  # the kubelet reused the IDs
            await k.start_container(pod, "warmup")  # init container starts first
            init_env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "warmup")))
            assert init_env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "500"
            await k.start_container(pod, "app")
            app_env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app")))
            assert app_env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "7000"
            assert app_env["TESSERA_DEVICE_CORE_LIMIT_0"] == "60"
            recorded = {c for _, c, _ in plane.allocated}
            assert recorded == {"warmup", "app"}

    run(main)


def test_task_priority_reaches_the_container_environment(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k, plane = node.kubelet, node.plane
            u = node.uuids
            pod, _ = bind_pod(
                plane,
                "mixed",
                [
                    ("serve", False, [(u[0], 1000, 50)]),
                    ("batch", False, [(u[1], 1000, 50)]),
                    ("plain", False, [(u[2], 1000, 50)]),
                ],
                priorities={"serve": 0, "batch": 1},
            )
            await k.admit(pod)
            for c in ("serve", "batch", "plain"):
                await k.start_container(pod, c)
            envs = {
                c: spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, c))) for c in pod.responses
            }
            assert envs["serve"]["TESSERA_TASK_PRIORITY"] == "0"
            assert envs["batch"]["TESSERA_TASK_PRIORITY"] == "1"
            assert "TESSERA_TASK_PRIORITY" not in envs["plain"]
            owners = {
                o["container"]: o
                for o in (
                    json.loads(p.read_text()) for p in (node.plugin.state_dir / "owners").iterdir()
                )
            }
            assert {c: o["priority"] for c, o in owners.items()} == {
                "serve": 0,
                "batch": 1,
                "plain": None,
            }
            # a record with a priority the plugin does not know is refused, naming the field
            bad, _ = bind_pod(
                plane, "too-low", [("app", False, [(u[3], 100, 0)])], priorities={"app": 2}
            )
            await k.admit(bad)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await k.start_container(bad, "app")
            assert "containers[0].priority=2 is not 0..1" in (err.value.details() or "")
            assert not (
                node.plugin.cdi_dir / f"tessera.io_gpu-{cdi_name(bad, 'app').split('=')[1]}.json"
            ).exists()

    run(main)


def test_host_path_mode_without_cdi(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp, TESSERA_DEVICE_MODE="paths") as node:
            k, plane = node.kubelet, node.plane
            u = node.uuids
            minor = {c.uuid: c.minor for c in node.gpu.cards}
            pod, _ = bind_pod(plane, "legacy", [("app", False, [(u[2], 1500, 25), (u[0], 900, 0)])])
            await k.admit(pod)
            resp = pod.responses["app"]
            assert not resp.cdi_devices
            card_devs = [d for d in resp.devices if d.container_path[11:].isdigit()]
            # ordinals are by card index in this mode: u[0] then u[2]
            assert [d.container_path for d in card_devs] == [
                f"/dev/nvidia{minor[u[0]]}",
                f"/dev/nvidia{minor[u[2]]}",
            ]
            for d in card_devs:
                assert not Path(d.host_path).exists(), "card path exists before the pod is verified"
            await k.start_container(pod, "app")
            for d in card_devs:
                target = Path(d.host_path).resolve()
                assert target == (node.gpu.dev / Path(d.container_path).name).resolve()
            config_mount = next(m for m in resp.mounts if m.container_path == "/etc/tessera")
            config = (Path(config_mount.host_path) / "config").read_text()
            assert "TESSERA_DEVICE_MEMORY_LIMIT_0=900\n" in config
            assert "TESSERA_DEVICE_MEMORY_LIMIT_1=1500\n" in config
            assert "TESSERA_DEVICE_CORE_LIMIT_1=25\n" in config
            assert resp.envs["TESSERA_CONFIG"] == "/etc/tessera/config"
            assert resp.envs["CUDA_VISIBLE_DEVICES"] == f"{u[0]},{u[2]}"
            assert resp.envs["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            # a refused pod gets no paths at all
            pod2, _ = bind_pod(plane, "legacy-2", [("app", False, [(u[1], 100, 0)])])
            plane.allocations.pop(("team-a", "legacy-2"))
            await k.admit(pod2)
            with pytest.raises(grpc.aio.AioRpcError):
                await k.start_container(pod2, "app")
            for d in pod2.responses["app"].devices:
                if d.container_path[11:].isdigit():
                    assert not Path(d.host_path).exists()
            for m in pod2.responses["app"].mounts:
                if m.container_path == "/etc/tessera":
                    assert not Path(m.host_path).exists()

    run(main)


def test_usage_metrics_survive_bad_region_files(short_tmp: Path) -> None:
    port = free_port()

    async def main() -> None:
        async with fake_node(short_tmp, TESSERA_METRICS_PORT=str(port)) as node:
            k, plane = node.kubelet, node.plane
            u = node.uuids
            pod, _ = bind_pod(plane, "metered", [("app", False, [(u[0], 2048, 0)])])
            await k.admit(pod)
            await k.start_container(pod, "app")
            name = cdi_name(pod, "app").partition("=")[2]
            region = node.plugin.region_dir / name / "region"
            assert region.parent.is_dir()
            region.write_bytes(region_bytes(2048, 123 << 20))
            who = {"namespace": "team-a", "pod": "metered", "container": "app"}
            m = await scrape_when(port, lambda m: "tessera_container_gpu_memory_used_bytes" in m)
            assert m["tessera_container_gpu_memory_used_bytes"] == [
                ({**who, "uuid": u[0], "ordinal": "0"}, float(123 << 20))
            ]
            assert m["tessera_container_gpu_memory_limit_bytes"] == [
                ({**who, "uuid": u[0], "ordinal": "0"}, float(2048 << 20))
            ]
            assert m["tessera_container_region_unreadable"] == [(who, 0.0)]
            bad_files = [
                (region_bytes(2048, 1)[:100], "region is 100 bytes"),
                (b"\x00garbage" * 50, "bad magic"),
            ]
            for bad, problem in bad_files:
                region.write_bytes(bad)
                await eventually(lambda p=problem: p in node.plugin.text(), what=problem)
                m = await scrape_when(
                    port, lambda m: m["tessera_container_region_unreadable"] == [(who, 1.0)]
                )
                assert "tessera_container_gpu_memory_used_bytes" not in m
                assert ({"uuid": u[0], "index": "0", "reason": ""}, 1.0) in m[
                    "tessera_card_healthy"
                ]
            # and the plugin still serves
            pod2, _ = bind_pod(plane, "next", [("app", False, [(u[1], 100, 0)])])
            await k.admit(pod2)
            await k.start_container(pod2, "app")

    run(main)


def test_task_priority_monitor_holds_and_releases_per_card(short_tmp: Path) -> None:
    """The plugin watches the launch counts in the regions and writes the holds: a low-priority
    container on the card of a busy high-priority one is held until it goes idle; one on
    another card, the high one itself, and one without a priority never are."""
    import ctypes

    from nodeplugin import shared_region as sr

    port = free_port()
    launches_at = ctypes.sizeof(sr.RegionHeader) + sr.RegionDevice.launches.offset  # device 0

    async def main() -> None:
        async with fake_node(
            short_tmp,
            TESSERA_PRIORITY_POLL_S="0.05",
            TESSERA_PRIORITY_BUSY_S="0.4",
            TESSERA_METRICS_PORT=str(port),
        ) as node:
            k, plane = node.kubelet, node.plane
            u = node.uuids
            pods = {}
            for name, card, prio in [
                ("hi", u[0], 0),
                ("lo", u[0], 1),
                ("elsewhere", u[1], 1),
                ("plain", u[0], None),
            ]:
                pod, _ = bind_pod(
                    plane,
                    name,
                    [("app", False, [(card, 1000, 0)])],
                    priorities=None if prio is None else {"app": prio},
                )
                await k.admit(pod)
                await k.start_container(pod, "app")
                pods[name] = pod
            regions = {}
            for name, pod in pods.items():
                regions[name] = (
                    node.plugin.region_dir / cdi_name(pod, "app").partition("=")[2] / "region"
                )
                regions[name].write_bytes(region_bytes(1000, 0))  # as a version 2 shim makes it

            def hold(name: str) -> int:
                return sr.read_region(regions[name]).hold_mask

            busy = True

            async def launch(name: str) -> None:
                n = 0
                while busy:
                    n += 1
                    fd = os.open(regions[name], os.O_RDWR)
                    os.pwrite(fd, n.to_bytes(8, "little"), launches_at)
                    os.close(fd)
                    await asyncio.sleep(0.02)

            launcher = asyncio.create_task(launch("hi"))
            await eventually(lambda: hold("lo") == 1, timeout=3, what="the low-priority hold")
            now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            assert sr.read_region(regions["lo"]).hold_until_ns > now

            def held(m: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
                return {s["pod"]: v for s, v in m.get("tessera_container_gpu_launches_held", [])}

            m = await scrape_when(port, lambda m: held(m).get("lo") == 1.0)
            assert held(m) == {"hi": 0.0, "lo": 1.0, "elsewhere": 0.0}
            for _ in range(10):  # it stays held while the high one is busy; the others never are
                await asyncio.sleep(0.05)
                assert (hold("lo"), hold("hi"), hold("elsewhere"), hold("plain")) == (1, 0, 0, 0)
            busy = False
            await launcher
            t_idle = time.monotonic()
            await eventually(lambda: hold("lo") == 0, timeout=3, what="the hold to be lifted")
            assert time.monotonic() - t_idle >= 0.3, "lifted before the busy window ended"
            # busy again, then the plugin stops: it lifts its holds on the way out
            busy = True
            launcher = asyncio.create_task(launch("hi"))
            await eventually(lambda: hold("lo") == 1, timeout=3, what="the hold again")
            busy = False
            await launcher
            assert node.plugin.stop() == 0
            assert hold("lo") == 0
            log = node.plugin.text()
            assert "team-a/lo app (priority 1) holds its launches on " + u[0] in log
            assert "team-a/lo app launches freely again" in log

    run(main)


def test_released_allocations_are_garbage_collected(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp, TESSERA_GC_INTERVAL_S="1") as node:
            k, plane = node.kubelet, node.plane
            keep, _ = bind_pod(plane, "keep", [("app", False, [(node.uuids[0], 100, 0)])])
            gone, _ = bind_pod(plane, "gone", [("app", False, [(node.uuids[1], 100, 0)])])
            for p in (keep, gone):
                await k.admit(p)
                await k.start_container(p, "app")
            spec_keep = cdi_name(keep, "app").partition("=")[2]
            spec_gone = cdi_name(gone, "app").partition("=")[2]
            k.remove(gone)
            await eventually(
                lambda: not list(node.plugin.cdi_dir.glob(f"*{spec_gone}*")),
                timeout=6,
                what="the released pod's spec to go",
            )
            assert not (node.plugin.region_dir / spec_gone).exists()
            assert list(node.plugin.cdi_dir.glob(f"*{spec_keep}*"))
            assert (node.plugin.region_dir / spec_keep).exists()

    run(main)


def test_plugin_restart_between_allocate_and_start_keeps_the_name(short_tmp: Path) -> None:
    """The kubelet caches Allocate's answer; the restarted plugin must still write that name."""

    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k, plane = node.kubelet, node.plane
            pod, _ = bind_pod(plane, "survivor", [("app", False, [(node.uuids[2], 2500, 40)])])
            await k.admit(pod)
            assert node.plugin.stop() == 0
            node.plugin = PluginProcess(short_tmp, node.gpu, k, plane)
            await k.wait_registered(count=2)
            await k.start_container(pod, "app")
            env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app")))
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "2500"

    run(main)


def test_cdi_variants_annotation_and_driver_devices(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(
            short_tmp, TESSERA_CDI_ANNOTATION="true", TESSERA_NVIDIA_CDI_KIND="nvidia.com/gpu"
        ) as node:
            k, plane = node.kubelet, node.plane
            u = node.uuids
            pod, _ = bind_pod(
                plane, "annotated", [("app", False, [(u[3], 100, 0), (u[1], 200, 0)])]
            )
            await k.admit(pod)
            resp = pod.responses["app"]
            assert not resp.cdi_devices
            ((key, value),) = resp.annotations.items()
            assert key.startswith("cdi.k8s.io/tessera_alloc-")
            names = value.split(",")
            assert names[1:] == [f"nvidia.com/gpu={u[1]}", f"nvidia.com/gpu={u[3]}"]
            await k.start_container(pod, "app")
            env = spec_env(cdi_spec(node.plugin.cdi_dir, names[0]))
            assert env["CUDA_VISIBLE_DEVICES"] == f"{u[3]},{u[1]}"

    run(main)


def test_gpu_containers_start_from_the_signed_annotation_while_the_control_plane_is_away(
    short_tmp: Path,
) -> None:
    """With the fallback on, a GPU container starts (and restarts) while the control plane is
    down, from the record the control plane signed onto the pod; the node reports what it
    gave once the control plane is back. An answer from the control plane stays final."""
    key = b"k" * 32
    root = short_tmp / "away"
    from tests.nodeplugin.harness.controlplane import FakeControlPlane

    api = FakeControlPlane()  # plays the API server for pod GETs
    api.add_token(TOKEN, NODE)

    async def main() -> None:
        async with fake_node(
            root,
            TESSERA_ALLOCATION_FALLBACK="true",
            TESSERA_CONTROLPLANE_WAIT_S="0.5",
            TESSERA_ALLOCATION_KEY_FILE=str(_write(root.parent / "key", key)),
            TESSERA_KUBE_API_URL=api.url,
            TESSERA_KUBE_TOKEN_FILE=str(_write(root.parent / "kube-token", TOKEN.encode())),
        ) as node:
            k, plane, u = node.kubelet, node.plane, node.uuids
            steady, raw = bind_pod(api, "steady", [("app", False, [(u[0], 2048, 20)])], key=key)
            plane.bind(raw, annotations=False)
            away, raw_away = bind_pod(api, "away", [("app", False, [(u[1], 1024, 0)])], key=key)
            plane.bind(raw_away, annotations=False)
            await k.admit(steady)
            await k.start_container(steady, "app")
            assert "signed allocation annotation" not in node.plugin.text()

            plane.stop()
            await k.admit(away)
            await k.start_container(away, "app")
            env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(away, "app")))
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "1024"
            assert "signed allocation annotation" in node.plugin.text()
            await k.start_container(steady, "app")  # a restart while away
            env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(steady, "app")))
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "2048"
            # what the pod's owner wrote is still nothing
            forged, _ = bind_pod(
                api, "forged", [("app", False, [(u[2], 81920, 100)])], key=b"x" * 32
            )
            await k.admit(forged)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await k.start_container(forged, "app")
            assert "not signed by the control plane" in (err.value.details() or "")

            plane.start()
            away_uid = json.loads(raw_away)["pod_uid"]
            await eventually(
                lambda: any(uid == away_uid for uid, _, _ in plane.allocated),
                timeout=10,
                what="the allocation reported once the control plane is back",
            )
            # back, and the ledger has no binding for a pod that carries a signed record:
            # the control plane's answer wins, nothing is started
            released, _ = bind_pod(api, "released", [("app", False, [(u[3], 500, 0)])], key=key)
            await k.admit(released)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await k.start_container(released, "app")
            assert "no active allocation" in (err.value.details() or "")
            name = cdi_name(released, "app").partition("=")[2]
            assert not list(node.plugin.cdi_dir.glob(f"*{name}*"))
            assert node.plugin.alive()

    try:
        run(main)
    finally:
        api.stop()


def _cards_reported(plane: Any, since: int = 0) -> list[set[tuple[bool, str]]]:
    """Each inventory report from `since` on, as the set of (healthy, reason) of its cards."""
    return [{(c["healthy"], c["health_reason"]) for c in body["cards"]} for _, _, body in
            plane.reports[since:]]  # fmt: skip


def test_a_successor_started_while_the_plugin_serves_takes_the_cards_over(short_tmp: Path) -> None:
    """The DaemonSet's next pod starts while this one still serves (a rolling update, or the
    replacement of a deleted pod that is still terminating): the kubelet must end up allocating
    through the successor, every device healthy, whichever of the two it heard from last."""

    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k, plane = node.kubelet, node.plane
            first = node.plugin
            node.plugin = PluginProcess(short_tmp, node.gpu, k, plane, log_name="successor.log")
            await eventually(lambda: len(k.endpoints) == 2 and k.streams() == 2, timeout=10,
                             what="the successor registered beside the first")  # fmt: skip
            assert k.refused == [], k.refused
            registered = len(k.updates)
            reports = len(plane.reports)
            assert first.stop() == 0
            await eventually(lambda: len(k.endpoints) == 1, what="the first plugin's endpoint gone")
            assert k.streams() == 1 and k.primary is not None
            await asyncio.sleep(0.3)
            assert set(k.health.values()) == {"Healthy"}, k.health
            assert all(set(snap.values()) == {"Healthy"} for _, snap in k.updates[registered:])
            # The first plugin left the cards to its successor without saying they stopped.
            assert not any((False, STOPPING) in r for r in _cards_reported(plane, reports))
            pod, _ = bind_pod(plane, "after-handover", [("app", False, [(node.uuids[1], 900, 10)])])
            await k.admit(pod)
            await k.start_container(pod, "app")
            env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app")))
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "900"

    run(main)


def test_the_kubelet_dropping_the_stream_gets_a_registration_and_the_cards_wait(
    short_tmp: Path,
) -> None:
    """When the kubelet lets the plugin's connection go while the plugin runs, the cards are
    reported unavailable (nothing new is placed on them) and the plugin registers again."""

    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k, plane = node.kubelet, node.plane
            await eventually(lambda: bool(plane.reports), what="a first report")
            assert _cards_reported(plane)[0] == {(True, "")}
            reports = len(plane.reports)
            await k.drop_connection()
            await eventually(lambda: set(k.health.values()) == {"Unhealthy"},
                             what="the kubelet marking the devices unhealthy")  # fmt: skip
            await eventually(lambda: {(False, UNREGISTERED)} in _cards_reported(plane, reports),
                             what="the cards reported unavailable")  # fmt: skip
            await eventually(lambda: set(k.health.values()) == {"Healthy"}, timeout=10,
                             what="a new registration")  # fmt: skip
            assert len(k.registrations) == 2
            await eventually(lambda: _cards_reported(plane)[-1] == {(True, "")},
                             what="the cards reported available again")  # fmt: skip
            assert "registering again" in node.plugin.text()

    run(main)


def test_a_plugin_that_stops_with_no_successor_says_its_cards_take_nothing_new(
    short_tmp: Path,
) -> None:
    """First the control plane hears the cards take no new pods, then the kubelet keeps the
    plugin's stream for the drain, so a pod bound just before is still admitted."""

    async def main() -> None:
        async with fake_node(short_tmp, TESSERA_STOP_DRAIN_S="0.5") as node:
            k, plane = node.kubelet, node.plane
            await eventually(lambda: bool(plane.reports), what="a first report")
            reports, updates = len(plane.reports), len(k.updates)
            assert await asyncio.to_thread(node.plugin.stop) == 0
            assert _cards_reported(plane, reports)[-1] == {(False, STOPPING)}
            told = plane.reports[-1][0]
            gone = await k.wait_update(lambda h: set(h.values()) == {"Unhealthy"}, since=updates)
            assert gone - told >= 0.45, f"the stream ended {gone - told:.2f}s after the report"

    run(main)


def test_a_heartbeat_in_flight_at_sigterm_does_not_land_after_the_last_report(
    short_tmp: Path,
) -> None:
    """A heartbeat the control plane is still handling when the plugin is told to stop must not
    be recorded after the plugin's last report: the ledger would say the cards are free again."""

    async def main() -> None:
        async with fake_node(short_tmp, TESSERA_STOP_DRAIN_S="0.1") as node:
            plane = node.plane
            await eventually(lambda: bool(plane.reports), what="a first report")
            plane.healthy_report_delay = 0.5
            plane.healthy_report_arrived.clear()
            assert await asyncio.to_thread(plane.healthy_report_arrived.wait, 5)  # in flight
            assert await asyncio.to_thread(node.plugin.stop) == 0
            assert _cards_reported(plane)[-1] == {(False, STOPPING)}

    run(main)


def test_a_resident_part_reaches_the_container_and_a_bad_one_is_refused(short_tmp: Path) -> None:
    """Virtual device memory through Allocate and PreStartContainer: the record's resident_mib
    becomes TESSERA_DEVICE_MEMORY_RESIDENT_0 beside the limit; a container whose record has
    none gets no such variable; a record whose resident_mib passes the slice is refused naming
    the field, and no spec is written for it."""

    async def main() -> None:
        async with fake_node(short_tmp) as node:
            k, plane, u = node.kubelet, node.plane, node.uuids
            pod, _ = bind_pod(
                plane,
                "spills",
                [("big", False, [(u[0], 6000, 0)]), ("plain", False, [(u[1], 1000, 0)])],
                modes={u[0]: {"resident_mib": 4000}},
            )
            await k.admit(pod)
            for c in ("big", "plain"):
                await k.start_container(pod, c)
            envs = {
                c: spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, c))) for c in pod.responses
            }
            assert envs["big"]["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "6000"
            assert envs["big"]["TESSERA_DEVICE_MEMORY_RESIDENT_0"] == "4000"
            assert not any(k_.startswith("TESSERA_DEVICE_MEMORY_RESIDENT") for k_ in envs["plain"])

            bad, _ = bind_pod(
                plane, "too-resident", [("app", False, [(u[2], 1000, 0)])],
                modes={u[2]: {"resident_mib": 1001}},
            )  # fmt: skip
            await k.admit(bad)
            specs = sorted(node.plugin.cdi_dir.iterdir())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await k.start_container(bad, "app")
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "containers[0].devices[0].resident_mib=1001 is not 1..memory_mib (1000)" in (
                err.value.details() or ""
            )
            assert sorted(node.plugin.cdi_dir.iterdir()) == specs  # nothing written for it

    run(main)
