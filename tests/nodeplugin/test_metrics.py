"""The node plugin's metrics against the fake NVML and the fake kubelet: per-card figures,
NVML errors, per-container memory and compute, containers that end."""

from __future__ import annotations

import time
from pathlib import Path
from typing import cast

import pytest

from e2e.ports import free_port
from nodeplugin.cards import Card
from nodeplugin.metrics import (
    CARD_LABELS,
    FAMILIES,
    Sampler,
    Used,
    container_compute,
    host_process,
    usage_entries,
)
from nodeplugin.nvml import Nvml, ProcessSample
from nodeplugin.owners import Owner
from nodeplugin.shared_region import parse_region
from nodeplugin.usage import ContainerUsage, UsageReader
from tests.nodeplugin.conftest import Node, eventually, fake_node, run
from tests.nodeplugin.harness.controlplane import FakeControlPlane
from tests.nodeplugin.harness.gpu import GpuNode
from tests.nodeplugin.harness.plugin import NODE
from tests.nodeplugin.helpers import (
    Scrape,
    bind_pod,
    cdi_name,
    region_bytes,
    scrape_when,
)

MODEL = "NVIDIA A100-SXM4-80GB"


def card(uuid: str, index: int, mode: str = "shared") -> dict[str, str]:
    return {"node": NODE, "card": uuid, "index": str(index), "model": MODEL, "mode": mode}


def series(m: Scrape, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(labels.items())): v for labels, v in m.get(name, [])}


def value(m: Scrape, name: str, labels: dict[str, str]) -> float | None:
    return series(m, name).get(tuple(sorted(labels.items())))


def fake_process(gpu: GpuNode, host_pid: int, container_pid: int, start_time: int) -> None:
    """/proc/<host pid> as the kernel shows a containerised process to the host."""
    d = gpu.proc / str(host_pid)
    d.mkdir(parents=True)
    tail = ["S", "1"] + ["0"] * 17 + [str(start_time), "0", "0"]
    (d / "stat").write_text(f"{host_pid} (python3 train.py) " + " ".join(tail) + "\n")
    (d / "status").write_text(f"Name:\tpython3\nNSpid:\t{host_pid}\t{container_pid}\n")


def test_host_process_reads_the_innermost_pid_and_the_start_time(tmp_path: Path) -> None:
    proc = tmp_path / "4242"
    proc.mkdir()
    fields = ["S", "1"] + ["0"] * 17 + ["123456", "0"]
    (proc / "stat").write_text("4242 (a) b (c) " + " ".join(fields) + "\n")
    (proc / "status").write_text("Name:\ta\nNSpid:\t4242\t17\t3\n")
    assert host_process(tmp_path, 4242) == (3, 123456)
    assert host_process(tmp_path, 4243) is None  # gone
    (proc / "status").write_text("Name:\ta\n")  # a kernel without NSpid: cannot map
    assert host_process(tmp_path, 4242) is None


def _usage(name: str, uuid: str, pid: int, start: int) -> ContainerUsage:
    owner = Owner(name, "ns", name, "main", (uuid,))
    return ContainerUsage(owner, parse_region(region_bytes(100, 1, pid=pid, start_time=start)), "")


def test_a_process_two_containers_could_own_is_nobodys() -> None:
    """Same pid and start time in two containers of one card: the sample is not given to
    either; each still gets its figure (0), as NVML saw the card."""
    usages = [_usage("a", "GPU-1", 7, 100), _usage("b", "GPU-1", 7, 100)]
    samples = {"GPU-1": [ProcessSample(900, 1, 80)]}
    got = container_compute(usages, samples, lambda pid: (7, 100))
    assert got == {("a", 0): 0.0, ("b", 0): 0.0}
    # one owner: its samples (several per process are averaged) add up, capped at 100
    usages = [_usage("a", "GPU-1", 7, 100)]
    samples = {"GPU-1": [ProcessSample(900, 1, 80), ProcessSample(900, 2, 60)]}
    assert container_compute(usages, samples, lambda pid: (7, 100)) == {("a", 0): 70.0}
    # a card NVML gave nothing for: no figure at all
    assert container_compute(usages, {}, lambda pid: (7, 100)) == {}


def test_card_labels_are_the_control_planes_plus_mode() -> None:
    """A panel joins the plugin's card series with the control plane's on card."""
    assert CARD_LABELS == ("node", "card", "index", "model", "mode")
    assert all(name.startswith("tessera_") for name in FAMILIES)


def test_every_card_figure_is_the_fake_nvmls(short_tmp: Path) -> None:
    port = free_port()

    async def main() -> None:
        async with fake_node(short_tmp, TESSERA_METRICS_PORT=str(port)) as node:
            u = node.uuids
            node.gpu.set_figures(u[0], util=37, temp=61, power_mw=251500, mem_used_mib=1024)
            node.gpu.set_figures(u[2], util=100, temp=80, power_mw=400000, mem_used_mib=81920)
            node.gpu.xid(u[0], 13)  # ignored for health, still counted
            node.gpu.xid(u[0], 79)
            m = await scrape_when(
                port,
                lambda m: (
                    value(m, "tessera_card_gpu_utilization_percent", card(u[0], 0)) == 37
                    and value(m, "tessera_card_xid_errors_total", card(u[0], 0)) == 2
                ),
            )
            assert value(m, "tessera_card_memory_used_bytes", card(u[0], 0)) == 1024 << 20
            assert value(m, "tessera_card_memory_total_bytes", card(u[0], 0)) == 81920 << 20
            assert value(m, "tessera_card_temperature_celsius", card(u[0], 0)) == 61
            assert value(m, "tessera_card_power_watts", card(u[0], 0)) == 251.5
            assert value(m, "tessera_card_gpu_utilization_percent", card(u[2], 2)) == 100
            assert value(m, "tessera_card_memory_used_bytes", card(u[2], 2)) == 81920 << 20
            assert value(m, "tessera_card_temperature_celsius", card(u[2], 2)) == 80
            assert value(m, "tessera_card_power_watts", card(u[2], 2)) == 400
            # a card with no figures set reads NVML's zeros: they are real readings, shown
            assert value(m, "tessera_card_gpu_utilization_percent", card(u[1], 1)) == 0
            assert value(m, "tessera_card_xid_errors_total", card(u[1], 1)) == 0
            assert len(series(m, "tessera_card_power_watts")) == 4
            assert "tessera_card_nvml_read_errors_total" not in m

    run(main)


def test_no_xid_count_without_xid_events(short_tmp: Path) -> None:
    """With health checks off nothing listens for XIDs: no count rather than a false zero."""
    port = free_port()

    async def main() -> None:
        async with fake_node(
            short_tmp, TESSERA_METRICS_PORT=str(port), TESSERA_HEALTH_CHECKS="false"
        ) as node:
            node.gpu.set_figures(node.uuids[0], util=12)
            m = await scrape_when(
                port,
                lambda m: (
                    value(m, "tessera_card_gpu_utilization_percent", card(node.uuids[0], 0)) == 12
                ),
            )
            assert "tessera_card_xid_errors_total" not in m

    run(main)


def test_an_nvml_error_drops_that_series_and_counts_it(short_tmp: Path) -> None:
    port = free_port()

    async def main() -> None:
        async with fake_node(short_tmp, TESSERA_METRICS_PORT=str(port)) as node:
            u = node.uuids
            node.gpu.set_figures(u[1], util=55, temp=70, power_mw=300000)
            await scrape_when(
                port, lambda m: value(m, "tessera_card_temperature_celsius", card(u[1], 1)) == 70
            )
            node.gpu.fail(u[1], "temp")
            node.gpu.fail(u[1], "power")
            failing = {**card(u[1], 1), "figure": "temperature"}
            m = await scrape_when(
                port, lambda m: (value(m, "tessera_card_nvml_read_errors_total", failing) or 0) >= 1
            )
            assert value(m, "tessera_card_temperature_celsius", card(u[1], 1)) is None
            assert value(m, "tessera_card_power_watts", card(u[1], 1)) is None
            # the card's other figures and the other cards are untouched
            assert value(m, "tessera_card_gpu_utilization_percent", card(u[1], 1)) == 55
            assert len(series(m, "tessera_card_temperature_celsius")) == 3
            assert {labels["figure"] for labels, _ in m["tessera_card_nvml_read_errors_total"]} == {
                "temperature",
                "power",
            }
            first = value(m, "tessera_card_nvml_read_errors_total", failing) or 0
            m = await scrape_when(
                port,
                lambda m: (value(m, "tessera_card_nvml_read_errors_total", failing) or 0) > first,
            )
            node.gpu.fail(u[1], "temp", on=False)
            m = await scrape_when(
                port, lambda m: value(m, "tessera_card_temperature_celsius", card(u[1], 1)) == 70
            )
            assert value(m, "tessera_card_power_watts", card(u[1], 1)) is None

    run(main)


async def start_pods(node: Node, placed: dict[str, tuple[str, int, int, int, int]]) -> None:
    """Pod name -> (card, memory MiB, compute %, bytes its region says used, start time): bound,
    admitted and started with one container `main`, whose region (pid 7) says so."""
    for pod_name, (uuid, mem, cores, used, start) in placed.items():
        pod, _ = bind_pod(node.plane, pod_name, [("main", False, [(uuid, mem, cores)])])
        await node.kubelet.admit(pod)
        await node.kubelet.start_container(pod, "main")
        region = node.plugin.region_dir / cdi_name(pod, "main").partition("=")[2]
        (region / "region").write_bytes(
            region_bytes(mem, used, core_pct=cores, pid=7, start_time=start)
        )


def test_container_memory_and_compute_carry_the_right_pod(short_tmp: Path) -> None:
    """Two containers on one card whose processes have the same pid inside their containers:
    NVML's host pids map to each by pid and start time; a sample of a process no container
    owns is nobody's. A card NVML gives no process samples for has no compute series."""
    port = free_port()

    async def main() -> None:
        async with fake_node(
            short_tmp, TESSERA_METRICS_PORT=str(port), TESSERA_PROC_ROOT=str(short_tmp / "proc")
        ) as node:
            gpu, u = node.gpu, node.uuids
            placed = {
                "train": (u[0], 4096, 60, 3000 << 20, 1000),
                "serve": (u[0], 2048, 30, 500 << 20, 2000),
                "batch": (u[1], 1024, 50, 100 << 20, 3000),
            }
            await start_pods(node, placed)
            fake_process(gpu, 4101, 7, 1000)
            fake_process(gpu, 4102, 7, 2000)
            fake_process(gpu, 4103, 7, 9999)  # a process of no Tessera container
            gpu.set_processes(u[0], [(4101, 42, 10), (4102, 17, 3), (4103, 90, 0)])
            gpu.set_processes(u[1], [(4104, 50, 0)])
            gpu.fail(u[1], "procs")

            def who(pod: str, uuid: str) -> dict[str, str]:
                return {
                    "namespace": "team-a",
                    "pod": pod,
                    "container": "main",
                    "uuid": uuid,
                    "ordinal": "0",
                }

            m = await scrape_when(
                port,
                lambda m: (
                    value(m, "tessera_container_gpu_sm_utilization_percent", who("train", u[0]))
                    == 42
                ),
            )
            for pod_name, (uuid, mem, cores, used, _) in placed.items():
                labels = who(pod_name, uuid)
                assert value(m, "tessera_container_gpu_memory_used_bytes", labels) == used
                assert value(m, "tessera_container_gpu_memory_limit_bytes", labels) == mem << 20
                assert value(m, "tessera_container_gpu_compute_share_percent", labels) == cores
            util = series(m, "tessera_container_gpu_sm_utilization_percent")
            assert util == {
                tuple(sorted(who("train", u[0]).items())): 42.0,
                tuple(sorted(who("serve", u[0]).items())): 17.0,
            }
            failing = {**card(u[1], 1), "figure": "process_utilization"}
            assert (value(m, "tessera_card_nvml_read_errors_total", failing) or 0) >= 1
            # NVML has no new sample for a container that stopped computing: it reads 0
            gpu.set_processes(u[0], [(4101, 64, 10)])
            m = await scrape_when(
                port,
                lambda m: (
                    value(m, "tessera_container_gpu_sm_utilization_percent", who("serve", u[0]))
                    == 0
                ),
            )
            assert (
                value(m, "tessera_container_gpu_sm_utilization_percent", who("train", u[0])) == 64
            )

    run(main)


def test_an_ended_container_leaves_the_series(short_tmp: Path) -> None:
    port = free_port()

    async def main() -> None:
        async with fake_node(
            short_tmp, TESSERA_METRICS_PORT=str(port), TESSERA_GC_INTERVAL_S="1"
        ) as node:
            k, plane = node.kubelet, node.plane
            u = node.uuids
            pods = {}
            for name, uuid in (("stays", u[0]), ("ends", u[1])):
                pod, _ = bind_pod(plane, name, [("main", False, [(uuid, 1000, 20)])])
                await k.admit(pod)
                await k.start_container(pod, "main")
                region = node.plugin.region_dir / cdi_name(pod, "main").partition("=")[2]
                (region / "region").write_bytes(region_bytes(1000, 10 << 20, core_pct=20))
                pods[name] = pod

            def pods_in(m: Scrape, name: str) -> set[str]:
                return {labels["pod"] for labels, _ in m.get(name, [])}

            used = "tessera_container_gpu_memory_used_bytes"
            await scrape_when(port, lambda m: pods_in(m, used) == {"stays", "ends"})
            k.remove(pods["ends"])
            m = await scrape_when(port, lambda m: pods_in(m, used) == {"stays"}, timeout=20)
            for name in (
                "tessera_container_gpu_memory_limit_bytes",
                "tessera_container_gpu_compute_share_percent",
                "tessera_container_region_unreadable",
            ):
                assert pods_in(m, name) == {"stays"}, name

    run(main)


class _FlakyNvml:
    """Just what the sampler asks of NVML, with a switch that makes the figures raise."""

    def __init__(self) -> None:
        self.broken = False

    def figures(self, uuid: str) -> tuple[dict[str, float], list[str]]:
        if self.broken:
            raise RuntimeError("a bug in the metrics code")
        return {"utilization": 5.0}, []

    def process_utilization(self, uuid: str, last_seen_us: int) -> list[ProcessSample]:
        return []


def test_a_failed_sample_empties_the_scrape_instead_of_serving_old_figures(
    tmp_path: Path,
) -> None:
    nvml = _FlakyNvml()
    sampler = Sampler(
        cast(Nvml, nvml),
        [Card("GPU-1", 0, MODEL, 81920, 0)],
        node=NODE,
        usage=UsageReader(tmp_path / "state", tmp_path / "regions"),
        proc_root=tmp_path,
        interval_s=0.01,
        modes=dict,
        health=dict,
        xids=dict,
    )
    sampler.start()
    try:
        deadline = time.monotonic() + 5
        while not sampler.latest() and time.monotonic() < deadline:
            time.sleep(0.01)
        names = {f.name for f in sampler.latest() if f.samples}
        assert "tessera_card_gpu_utilization_percent" in names
        nvml.broken = True
        while sampler.latest() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.latest() == []
        nvml.broken = False
        while not sampler.latest() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sampler.latest(), "sampling did not resume"
    finally:
        sampler.stop()
        sampler.join(5)


def _usage_reports(plane: FakeControlPlane) -> list[list[dict[str, object]]]:
    with plane.lock:
        return [body["usage"] for _, _, body in plane.reports if "usage" in body]


def test_the_heartbeat_carries_each_containers_use_of_its_cards(short_tmp: Path) -> None:
    """What `kubectl tessera top` shows travels on the inventory report: memory from the
    container's region (rounded up to MiB, held to the card's memory however the region lies),
    compute from NVML's samples of its processes, none where NVML gives none."""

    async def main() -> None:
        async with fake_node(short_tmp, TESSERA_PROC_ROOT=str(short_tmp / "proc")) as node:
            plane, gpu, u = node.plane, node.gpu, node.uuids
            placed = {
                "train": (u[0], 4096, 60, (3000 << 20) + 1, 1000),
                "liar": (u[1], 1024, 50, 1 << 50, 3000),  # a region claiming a PiB
            }
            await start_pods(node, placed)
            fake_process(gpu, 4101, 7, 1000)
            gpu.set_processes(u[0], [(4101, 42, 10)])
            gpu.fail(u[1], "procs")  # no per-process figures there: compute is not known

            def entries() -> dict[str, dict[str, object]]:
                reports = _usage_reports(plane)
                return {str(e["pod"]): e for e in reports[-1]} if reports else {}

            await eventually(
                lambda: entries().get("train", {}).get("compute_used_percent") == 42,
                timeout=10,
                what="a heartbeat with the trainer's compute",
            )
            got = entries()
            assert got["train"] == {
                "namespace": "team-a",
                "pod": "train",
                "container": "main",
                "card": u[0],
                "memory_used_mib": 3001,
                "compute_used_percent": 42,
            }
            assert got["liar"]["memory_used_mib"] == 81920  # the card's memory, not a PiB
            assert got["liar"]["compute_used_percent"] is None

    run(main)


@pytest.mark.parametrize(
    ("refused", "key", "message"),
    [
        ("takes_usage", "usage", "does not take the containers' usage"),
        ("takes_memory", "spill_reserve_mib", "does not take the node's oversubscription"),
    ],
)
def test_a_control_plane_that_refuses_a_part_keeps_the_heartbeat(
    short_tmp: Path, refused: str, key: str, message: str
) -> None:
    """One older than usage reports refuses `usage`; one older than virtual device memory the
    node's factor and reserve (without them it takes the node as one that spills nothing)."""

    async def main() -> None:
        async with fake_node(short_tmp, **oversubscribing(short_tmp)) as node:
            plane = node.plane
            setattr(plane, refused, False)
            with plane.lock:
                before = len(plane.reports)
            await eventually(
                lambda: len(plane.reports) >= before + 3, timeout=10, what="three more heartbeats"
            )
            # the plugin sends one report at a time: one may have been taken as the flag turned
            with plane.lock:
                assert all(key not in body for _, _, body in plane.reports[before + 1 :])
            assert message in node.plugin.text()

    run(main)


def test_usage_entries_are_one_per_container_and_card_of_this_node() -> None:
    def owner(name: str, container: str = "main") -> Owner:
        return Owner(name, "ns", "p", container, ("GPU-1",))

    used = [
        Used(owner("old"), "GPU-1", 0, None),  # a restarted container's old record
        Used(owner("new"), "GPU-1", 5 << 20, 30.4),
        Used(owner("other", "side"), "GPU-9", 1 << 20, None),  # not a card of this node
    ]
    assert usage_entries(used, {"GPU-1": 81920}) == [
        {
            "namespace": "ns",
            "pod": "p",
            "container": "main",
            "card": "GPU-1",
            "memory_used_mib": 5,
            "compute_used_percent": 30,
        }
    ]


def test_usage_entries_say_what_is_resident_and_spilled_on_a_node_that_oversubscribes() -> None:
    def owner(name: str) -> Owner:
        return Owner(name, "ns", name, "main", ("GPU-1",))

    used = [
        Used(owner("big"), "GPU-1", 6000 << 20, None, 2000 << 20),
        Used(owner("fits"), "GPU-1", 1 << 20, None),
        Used(owner("liar"), "GPU-1", 1 << 50, None, 1 << 50),  # a region claiming a PiB spilled
    ]
    got = {e["pod"]: e for e in usage_entries(used, {"GPU-1": 4096}, spill=True, host_mib=65536)}
    assert {k: got["big"][k] for k in ("memory_used_mib", "memory_resident_mib")} == {
        "memory_used_mib": 6000,
        "memory_resident_mib": 4000,
    }
    assert got["big"]["memory_spilled_mib"] == 2000
    assert (got["fits"]["memory_resident_mib"], got["fits"]["memory_spilled_mib"]) == (1, 0)
    # held to the node's memory, and the used figure to the card plus that
    assert got["liar"]["memory_spilled_mib"] == 65536
    assert got["liar"]["memory_used_mib"] == 4096 + 65536
    # without the node's memory, to the largest factor's share of the card
    (liar,) = usage_entries(used[2:], {"GPU-1": 4096}, spill=True)
    assert liar["memory_spilled_mib"] == 16 * 4096


def test_a_node_that_does_not_oversubscribe_reports_as_before() -> None:
    """A region's spilled count on a node that gives no slice a resident part is the
    container's invention: the entry has no spill keys and its memory is held to the card."""
    used = [Used(Owner("a", "ns", "p", "main", ("GPU-1",)), "GPU-1", 1 << 50, None, 1 << 50)]
    (entry,) = usage_entries(used, {"GPU-1": 4096})
    assert set(entry) == {
        "namespace", "pod", "container", "card", "memory_used_mib", "compute_used_percent",
    }  # fmt: skip
    assert entry["memory_used_mib"] == 4096


def oversubscribing(short_tmp: Path) -> dict[str, str]:
    proc = short_tmp / "proc"
    proc.mkdir(exist_ok=True)
    (proc / "meminfo").write_text("MemTotal:       67108864 kB\n")  # 64 GiB
    return {
        "TESSERA_PROC_ROOT": str(proc),
        "TESSERA_MEMORY_OVERSUBSCRIPTION": "1.50",
        "TESSERA_SPILL_RESERVE_MIB": "16384",
    }


def test_an_oversubscribing_node_reports_its_factor_reserve_and_each_containers_spill(
    short_tmp: Path,
) -> None:
    port = free_port()

    async def main() -> None:
        env = oversubscribing(short_tmp)
        async with fake_node(short_tmp, TESSERA_METRICS_PORT=str(port), **env) as node:
            plane, u = node.plane, node.uuids
            pod, _ = bind_pod(plane, "big", [("main", False, [(u[0], 6000, 0)])])
            await node.kubelet.admit(pod)
            await node.kubelet.start_container(pod, "main")
            region = node.plugin.region_dir / cdi_name(pod, "main").partition("=")[2]
            (region / "region").write_bytes(region_bytes(6000, 5000 << 20, spilled=1000 << 20))

            def last() -> dict[str, object]:
                with plane.lock:
                    return plane.reports[-1][2] if plane.reports else {}

            await eventually(
                lambda: bool(cast(list[object], last().get("usage", []))),
                timeout=10,
                what="a heartbeat with the container's usage",
            )
            body = last()
            assert (
                body["memory_oversubscription"],
                body["spill_reserve_mib"],
                body["host_memory_mib"],
            ) == ("1.5", 16384, 65536)
            (entry,) = cast(list[dict[str, object]], body["usage"])
            assert (entry["memory_used_mib"], entry["memory_resident_mib"]) == (5000, 4000)
            assert entry["memory_spilled_mib"] == 1000
            labels = {
                "namespace": "team-a",
                "pod": "big",
                "container": "main",
                "uuid": u[0],
                "ordinal": "0",
            }
            m = await scrape_when(
                port,
                lambda m: (
                    value(m, "tessera_container_gpu_memory_spilled_bytes", labels) is not None
                ),
            )
            assert value(m, "tessera_container_gpu_memory_spilled_bytes", labels) == 1000 << 20
            assert value(m, "tessera_container_gpu_memory_resident_bytes", labels) == 4000 << 20
            assert value(m, "tessera_container_gpu_memory_used_bytes", labels) == 5000 << 20

    run(main)
