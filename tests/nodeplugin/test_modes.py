"""Card modes on the node (docs/card-modes.md): MIG instances, the MPS daemon, exclusive cards,
end to end through the kubelet harness and the fake NVML's MIG model."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.nodeplugin.conftest import Node, eventually, fake_node, run
from tests.nodeplugin.harness.gpu import cards
from tests.nodeplugin.harness.kubelet import Pod
from tests.nodeplugin.harness.plugin import PluginProcess
from tests.nodeplugin.helpers import bind_pod, cdi_name, cdi_spec, spec_env, spec_nodes

PROFILE_3G = 9  # NVML's profile ID of 3g.40gb on an A100/H100 80GB
P3G_LOW = {"profile": "3g.40gb", "start": 0, "size": 4}
P3G_HIGH = {"profile": "3g.40gb", "start": 4, "size": 4}

FAKE_MPS = """#!/bin/bash
# A stand-in for nvidia-cuda-mps-control: -d leaves a "daemon" behind (named as this program,
# as the real one's is) and writes its PID where the real one does; otherwise it reads a
# command ("quit") from stdin.
pipe="$CUDA_MPS_PIPE_DIRECTORY"
if [ "$1" = "-d" ]; then
    echo "$CUDA_VISIBLE_DEVICES $CUDA_MPS_LOG_DIRECTORY" > "$pipe/../started-for"
    (exec -a "$0" sleep 3600) </dev/null >/dev/null 2>&1 &
    echo $! > "$pipe/nvidia-cuda-mps-control.pid"
    exit 0
fi
read -r cmd
if [ "$cmd" = quit ]; then
    kill "$(cat "$pipe/nvidia-cuda-mps-control.pid")"
fi
"""


def mig(p: dict[str, Any]) -> dict[str, Any]:
    return {"mode": "mig", "mig": p}


@contextlib.asynccontextmanager
async def mig_node(root: Path, **env: str) -> AsyncIterator[Node]:
    """Four A100s, the first two MIG capable; card 0 in mode mig."""
    card_list = [dataclasses.replace(c, mig=i < 2) for i, c in enumerate(cards(4))]
    extra = {"TESSERA_PROC_ROOT": str(root / "proc"), **env}
    async with fake_node(root, card_list, **extra) as node:
        node.plane.modes = {node.uuids[0]: "mig", node.uuids[1]: "mig"}
        await eventually(
            lambda: all(node.gpu.mig_state(u)["mode"] == (1, 1) for u in node.uuids[:2]),
            timeout=5,
            what="MIG turned on for the mig cards",
        )
        yield node


def mig_report(node: Node, uuid: str) -> dict[str, Any] | None:
    """The latest inventory report's mig object of a card."""
    for _, _, body in reversed(node.plane.reports):
        for c in body["cards"]:
            if c["uuid"] == uuid:
                mig_obj: dict[str, Any] | None = c.get("mig")
                return mig_obj
    return None


async def started(node: Node, name: str, slices: list[tuple[str, int, int]], modes: Any) -> Pod:
    pod, _ = bind_pod(node.plane, name, [("app", False, slices)], modes=modes)
    await node.kubelet.admit(pod)
    await node.kubelet.start_container(pod, "app")
    return pod


def test_a_mig_pod_gets_exactly_its_instance_which_goes_with_the_pod(short_tmp: Path) -> None:
    async def main() -> None:
        async with mig_node(short_tmp, TESSERA_GC_INTERVAL_S="1") as node:
            gpu, card = node.gpu, node.uuids[0]
            await eventually(
                lambda: (mig_report(node, card) or {}).get("enabled") is True,
                what="the report to say MIG is on",
            )
            assert mig_report(node, node.uuids[2]) is None, "a card without MIG reports none"
            pod = await started(node, "mig-pod", [(card, 40192, 42)], {card: mig(P3G_HIGH)})
            st = gpu.mig_state(card)
            ((gi, profile, start, size),) = st["gi"]
            assert (profile, start, size) == (PROFILE_3G, 4, 4)
            ((ci_gi, ci, ci_profile),) = st["ci"]
            assert ci_gi == gi and ci_profile == 2  # the 3-slice compute instance: all of it
            spec = cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app"))
            env = spec_env(spec)
            mig_uuid = env["CUDA_VISIBLE_DEVICES"]
            assert mig_uuid.startswith("MIG-")
            assert env["NVIDIA_VISIBLE_DEVICES"] == mig_uuid
            assert not [k for k in env if k.startswith("TESSERA_DEVICE_")], env
            assert spec_nodes(spec) == [
                "/dev/nvidia0",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                f"/dev/nvidia-caps/nvidia-cap{gpu.mig_minor(0, gi)}",
                f"/dev/nvidia-caps/nvidia-cap{gpu.mig_minor(0, gi, ci)}",
            ]
            # the UUID is the one NVML lists for that instance
            await eventually(
                lambda: (
                    (mig_report(node, card) or {}).get("instances")
                    == [{"profile": "3g.40gb", "start": 4, "size": 4, "uuid": mig_uuid}]
                ),
                what="the instance in the inventory",
            )
            # a container restart adopts the instance
            await node.kubelet.start_container(pod, "app")
            assert gpu.mig_state(card)["gi"] == st["gi"]
            env2 = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app")))
            assert env2["CUDA_VISIBLE_DEVICES"] == mig_uuid
            # the pod ends: the instance goes with its spec
            node.kubelet.remove(pod)
            await eventually(
                lambda: gpu.mig_state(card)["gi"] == [] and gpu.mig_state(card)["ci"] == [],
                timeout=6,
                what="the instance to be destroyed",
            )
            assert not list(node.plugin.cdi_dir.glob(f"*{cdi_name(pod, 'app').partition('=')[2]}*"))

    run(main)


def test_an_overlapping_placement_is_refused_naming_it(short_tmp: Path) -> None:
    async def main() -> None:
        async with mig_node(short_tmp) as node:
            gpu, card = node.gpu, node.uuids[0]
            # someone else's 1g.10gb on memory slice 5
            foreign = {"mode": (1, 1), "gi": [(3, 19, 5, 1)], "ci": [(3, 0, 0)]}
            gpu.set_mig_state(card, foreign)
            pod, _ = bind_pod(
                node.plane,
                "clash",
                [("app", False, [(card, 40192, 42)])],
                modes={card: mig(P3G_HIGH)},
            )
            await node.kubelet.admit(pod)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await node.kubelet.start_container(pod, "app")
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            details = err.value.details() or ""
            assert "MIG 3g.40gb at placement start=4 size=4" in details, details
            assert "Insufficient resources" in details and "1g.10gb at start=5" in details
            assert gpu.mig_state(card)["gi"] == foreign["gi"], "the other instance is untouched"
            assert not list(node.plugin.cdi_dir.glob("*.json")), "nothing written"
            assert node.plugin.alive()

    run(main)


def test_a_restart_adopts_held_instances_and_destroys_its_orphans(short_tmp: Path) -> None:
    async def main() -> None:
        async with mig_node(short_tmp) as node:
            gpu, k = node.gpu, node.kubelet
            card, other = node.uuids[0], node.uuids[1]
            keep = await started(node, "keep", [(card, 40192, 42)], {card: mig(P3G_LOW)})
            gone = await started(node, "gone", [(card, 40192, 42)], {card: mig(P3G_HIGH)})
            assert sorted(g[2] for g in gpu.mig_state(card)["gi"]) == [0, 4]
            keep_uuid = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(keep, "app")))[
                "CUDA_VISIBLE_DEVICES"
            ]
            # an instance Tessera did not make, on the other MIG card
            foreign = {"mode": (1, 1), "gi": [(1, 19, 0, 1)], "ci": [(1, 0, 0)]}
            gpu.set_mig_state(other, foreign)
            assert node.plugin.stop() == 0
            k.remove(gone)  # the pod ended while the plugin was away
            node.plugin = PluginProcess(
                short_tmp, gpu, k, node.plane, TESSERA_PROC_ROOT=str(short_tmp / "proc")
            )
            await k.wait_registered(count=2)
            await eventually(
                lambda: [g[2] for g in gpu.mig_state(card)["gi"]] == [0],
                timeout=6,
                what="the orphan destroyed, the held one kept",
            )
            assert gpu.mig_state(other)["gi"] == foreign["gi"], "someone else's is left alone"
            await eventually(
                lambda: "was not created by Tessera; left alone" in node.plugin.text(),
                what="the foreign instance reported",
            )
            await k.start_container(keep, "app")  # the kept pod's container restarts
            env = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(keep, "app")))
            assert env["CUDA_VISIBLE_DEVICES"] == keep_uuid
            assert len(gpu.mig_state(card)["gi"]) == 1

    run(main)


def test_mig_pending_a_reset_keeps_the_card_out_until_the_reset(short_tmp: Path) -> None:
    async def main() -> None:
        card_list = [dataclasses.replace(c, mig=i == 0) for i, c in enumerate(cards(2))]
        async with fake_node(short_tmp, card_list, TESSERA_PROC_ROOT=str(short_tmp / "p")) as node:
            gpu, k, card = node.gpu, node.kubelet, node.uuids[0]
            gpu.mig_needs_reset()
            node.plane.modes = {card: "mig"}
            ids = {f"{card}::{s}" for s in range(4)}
            await k.wait_update(lambda s: all(s[i] == "Unhealthy" for i in ids), timeout=5)

            def reported() -> dict[str, Any]:
                return next(c for c in node.plane.reports[-1][2]["cards"] if c["uuid"] == card)

            await eventually(
                lambda: (
                    "waits for a GPU reset" in reported()["health_reason"]
                    and reported()["mig"]["enabled"] is False
                ),
                what="the reason in the report",
            )
            gpu.mig_reset(card)
            await k.wait_update(lambda s: all(s[i] == "Healthy" for i in ids), timeout=5)
            await eventually(lambda: reported()["mig"]["enabled"] is True, what="enabled")

    run(main)


def test_exclusive_cards_are_given_whole_without_limits(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp) as node:
            card = node.uuids[1]
            pod = await started(node, "whole", [(card, 81920, 100)], {card: {"mode": "exclusive"}})
            spec = cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app"))
            env = spec_env(spec)
            assert env["CUDA_VISIBLE_DEVICES"] == card
            assert not [k for k in env if k.startswith(("TESSERA_DEVICE_", "CUDA_MPS_"))], env
            assert "/dev/nvidia1" in spec_nodes(spec)

    run(main)


def _kill_daemon(pid_file: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_mps_daemon_serves_mps_cards_and_its_death_marks_them_unhealthy(short_tmp: Path) -> None:
    async def main() -> None:
        control = short_tmp / "fake-mps-control"
        control.write_text(FAKE_MPS)
        control.chmod(0o755)
        pid_file = short_tmp / "state" / "mps" / "pipe" / "nvidia-cuda-mps-control.pid"
        try:
            async with fake_node(
                short_tmp, TESSERA_MPS_CONTROL=str(control), TESSERA_MPS_POLL_S="0.1"
            ) as node:
                k, card = node.kubelet, node.uuids[2]
                # a PID file left behind that names some other live process is no daemon
                pid_file.parent.mkdir(parents=True, exist_ok=True)
                pid_file.write_text(f"{os.getpid()}\n")
                node.plane.modes = {card: "mps"}
                await eventually(
                    lambda: f"runs for {card}" in node.plugin.text(),
                    what="the plugin to see the MPS daemon run",
                )
                assert pid_file.read_text().strip() != str(os.getpid())
                started_for = (short_tmp / "state" / "mps" / "started-for").read_text().split()
                assert started_for == [card, str(short_tmp / "state" / "mps" / "log")]
                pod = await started(
                    node,
                    "mps-pod",
                    [(node.uuids[0], 2048, 20), (card, 8192, 30)],
                    {card: {"mode": "mps"}},
                )
                spec = cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app"))
                env = spec_env(spec)
                # ordinal 0 is a shared slice (shim limits), ordinal 1 the mps one (MPS limits)
                assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "2048"
                assert "TESSERA_DEVICE_MEMORY_LIMIT_1" not in env
                assert "TESSERA_DEVICE_CORE_LIMIT_1" not in env
                assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=8192M"
                assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
                assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
                mounts = spec["devices"][0]["containerEdits"]["mounts"]
                assert {
                    "hostPath": str(pid_file.parent),
                    "containerPath": "/tmp/nvidia-mps",
                    "type": "bind",
                    "options": ["rw", "nosuid", "nodev", "bind"],
                } in mounts
                # the daemon dies: the mps card is out, the others stay; then it is back
                ids = {f"{card}::{s}" for s in range(4)}
                first_pid = pid_file.read_text()
                n = len(k.updates)
                _kill_daemon(pid_file)
                await k.wait_update(
                    lambda s: (
                        all(s[i] == "Unhealthy" for i in ids)
                        and all(h == "Healthy" for i, h in s.items() if i not in ids)
                    ),
                    timeout=3,
                    since=n,
                )
                await eventually(
                    lambda: any(
                        c["uuid"] == card and "MPS control daemon" in c["health_reason"]
                        for _, _, r in node.plane.reports
                        for c in r["cards"]
                    ),
                    what="the reason naming the daemon in the report",
                )
                await k.wait_update(
                    lambda s: all(s[i] == "Healthy" for i in ids), timeout=5, since=n + 1
                )
                assert pid_file.read_text() != first_pid, "a new daemon runs"
                # no mps card any more: the daemon is told to quit
                node.plane.modes = {}
                await eventually(lambda: not _alive_pid(pid_file), timeout=5, what="quit")
        finally:
            _kill_daemon(pid_file)

    run(main)


def _alive_pid(pid_file: Path) -> bool:
    try:
        stat = Path(f"/proc/{int(pid_file.read_text())}/stat").read_text()
    except (OSError, ValueError):
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def test_host_path_mode_refuses_mig_and_mps_slices_loudly(short_tmp: Path) -> None:
    async def main() -> None:
        async with fake_node(short_tmp, TESSERA_DEVICE_MODE="paths") as node:
            card = node.uuids[3]
            pod, _ = bind_pod(
                node.plane,
                "mps-paths",
                [("app", False, [(card, 4096, 30)])],
                modes={card: {"mode": "mps"}},
            )
            await node.kubelet.admit(pod)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await node.kubelet.start_container(pod, "app")
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "mps needs CDI (TESSERA_DEVICE_MODE=cdi)" in (err.value.details() or "")

    run(main)


def test_a_busy_instance_outlives_its_pod_until_nvml_lets_it_go(short_tmp: Path) -> None:
    async def main() -> None:
        async with mig_node(short_tmp, TESSERA_GC_INTERVAL_S="1") as node:
            gpu, card = node.gpu, node.uuids[1]
            pod = await started(
                node,
                "busy",
                [(card, 9728, 14)],
                {card: mig({"profile": "1g.10gb", "start": 6, "size": 1})},
            )
            mig_uuid = spec_env(cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "app")))[
                "CUDA_VISIBLE_DEVICES"
            ]
            busy = gpu.state / "busy" / mig_uuid
            busy.parent.mkdir(exist_ok=True)
            busy.touch()  # a process still runs on the instance
            node.kubelet.remove(pod)
            await eventually(
                lambda: "destroying MIG GPU instance" in node.plugin.text(),
                timeout=6,
                what="NVML's refusal logged",
            )
            assert [g[2:] for g in gpu.mig_state(card)["gi"]] == [(6, 1)]
            busy.unlink()
            await eventually(
                lambda: gpu.mig_state(card)["gi"] == [], timeout=6, what="destroyed once free"
            )

    run(main)


def test_a_missing_mps_binary_keeps_the_mps_cards_out_saying_why(short_tmp: Path) -> None:
    async def main() -> None:
        missing = str(short_tmp / "no-such-mps-control")
        async with fake_node(
            short_tmp, TESSERA_MPS_CONTROL=missing, TESSERA_MPS_POLL_S="0.1"
        ) as node:
            card = node.uuids[1]
            node.plane.modes = {card: "mps"}
            ids = {f"{card}::{s}" for s in range(4)}
            await node.kubelet.wait_update(
                lambda s: (
                    all(s[i] == "Unhealthy" for i in ids)
                    and all(h == "Healthy" for i, h in s.items() if i not in ids)
                ),
                timeout=5,
            )
            await eventually(
                lambda: any(
                    c["uuid"] == card
                    and f"MPS control daemon ({missing}) does not start" in c["health_reason"]
                    for _, _, r in node.plane.reports
                    for c in r["cards"]
                ),
                what="the reason in the report",
            )
            node.plane.modes = {}  # the card leaves mps mode: nothing to run, healthy again
            await node.kubelet.wait_update(lambda s: all(s[i] == "Healthy" for i in ids), timeout=5)

    run(main)
