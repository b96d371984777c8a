"""Benchmark of the node plugin's hot paths, against a real ``python -m nodeplugin`` process.

Run: ``python bench/bench_nodeplugin.py [--pods 300] [--cards 8] [--live 60] [--flips 20]``

The stand-ins are the test harness's (``tests/nodeplugin/harness``): the fake
``libnvidia-ml.so.1`` (built with gcc), a kubelet speaking the real gRPC APIs over unix
sockets, and a control plane on loopback HTTP that follows docs/allocation.md. Figures:

- Allocate and PreStartContainer latency as the kubelet sees it (PreStartContainer is the
  exact-resolution step: PodResources List, GET allocation, POST allocated, CDI spec written),
  with ``--live`` pods on the node so every List has realistic size. Target p99 ≤ 50 ms.
- GetPreferredAllocation (one PodResources List plus cached allocation GETs).
- ListAndWatch update after a health change: from an XID written to the fake driver to the
  kubelet's stream showing the card Unhealthy (includes the NVML event wait). Target ≤ 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nodeplugin.pb import dp
from tests.nodeplugin.harness.controlplane import FakeControlPlane, record
from tests.nodeplugin.harness.gpu import GpuNode, cards
from tests.nodeplugin.harness.kubelet import Container, FakeKubelet, Pod
from tests.nodeplugin.harness.plugin import NODE, PluginProcess


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def line(name: str, values: list[float], target: float | None = None) -> None:
    verdict = ""
    if target is not None:
        verdict = "  OK" if pct(values, 99) <= target else f"  OVER target {target:g} ms"
    print(
        f"{name:<40} n={len(values):<5} p50={pct(values, 50):7.2f} ms  "
        f"p99={pct(values, 99):7.2f} ms  max={max(values):7.2f} ms  "
        f"mean={statistics.fmean(values):7.2f} ms{verdict}"
    )


async def bench(args: argparse.Namespace, root: Path) -> int:
    rng = random.Random(args.seed)
    gpu = GpuNode(root, cards(args.cards))
    plane = FakeControlPlane()
    kubelet = FakeKubelet(root / "k")
    await kubelet.start()
    plugin = PluginProcess(
        root,
        gpu,
        kubelet,
        plane,
        TESSERA_SLOTS=str(args.slots),
        TESSERA_LOG_LEVEL="warning",
        TESSERA_HEALTH_RECOVERY_S="0.2",
        TESSERA_HEALTH_PROBE_S="0.1",
        TESSERA_PRESTART_TIMEOUT_S="10",
    )
    try:
        try:
            await kubelet.wait_registered(timeout=20)
        except TimeoutError:
            print(f"error: the plugin did not register:\n{plugin.text()}", file=sys.stderr)
            return 1
        uuids = [c.uuid for c in gpu.cards]
        client = kubelet.client
        assert client is not None
        alloc_ms: list[float] = []
        pre_ms: list[float] = []
        both_ms: list[float] = []
        pref_ms: list[float] = []
        live: list[Pod] = []
        for i in range(args.pods + 20):
            warmup = i < 20
            n = 2 if i % 5 == 0 else 1
            chosen = rng.sample(uuids, n)
            uid = f"uid-{i}"
            plane.bind(
                record(
                    uid,
                    "bench",
                    f"pod-{i}",
                    NODE,
                    [("app", 0, False, [(u, 1000 + i, 10) for u in chosen])],
                )
            )
            pod = Pod("bench", f"pod-{i}", [Container("app", n)])
            kubelet.pods[(pod.namespace, pod.name)] = pod
            free = sorted(
                d for d, h in kubelet.health.items() if h == "Healthy" and d not in kubelet.in_use()
            )
            t0 = time.perf_counter()
            pref = await client.GetPreferredAllocation(
                dp.PreferredAllocationRequest(
                    container_requests=[
                        dp.ContainerPreferredAllocationRequest(
                            available_deviceIDs=free, allocation_size=n
                        )
                    ]
                )
            )
            t1 = time.perf_counter()
            device_ids = list(pref.container_responses[0].deviceIDs)
            resp = await client.Allocate(
                dp.AllocateRequest(
                    container_requests=[dp.ContainerAllocateRequest(devices_ids=device_ids)]
                )
            )
            t2 = time.perf_counter()
            pod.devices["app"] = device_ids
            pod.responses["app"] = resp.container_responses[0]
            t3 = time.perf_counter()
            await client.PreStartContainer(dp.PreStartContainerRequest(devices_ids=device_ids))
            t4 = time.perf_counter()
            if not warmup:
                pref_ms.append((t1 - t0) * 1000)
                alloc_ms.append((t2 - t1) * 1000)
                pre_ms.append((t4 - t3) * 1000)
                both_ms.append((t2 - t1 + t4 - t3) * 1000)
            live.append(pod)
            if len(live) > args.live:
                kubelet.remove(live.pop(0))
        wrong = len(plane.allocated) - (args.pods + 20)
        print(
            f"node plugin benchmark: {args.cards} cards x {args.slots} slots, {args.pods} pods "
            f"(+20 warm-up), {args.live} pods live on the node, control plane on loopback"
        )
        line("GetPreferredAllocation", pref_ms)
        line("Allocate", alloc_ms)
        line("PreStartContainer (exact resolution)", pre_ms)
        line("Allocate + PreStartContainer", both_ms, target=50.0)

        flips: list[float] = []
        backs: list[float] = []
        for j in range(args.flips):
            card = uuids[j % len(uuids)]
            probe = f"{card}::0"
            since = len(kubelet.updates)
            t0 = time.monotonic()
            gpu.xid(card, 79)
            t_bad = await kubelet.wait_update(
                lambda s, p=probe: s.get(p) == "Unhealthy", timeout=5, since=since
            )
            flips.append((t_bad - t0) * 1000)
            since = (
                next(
                    i
                    for i in range(since, len(kubelet.updates))
                    if kubelet.updates[i][1].get(probe) == "Unhealthy"
                )
                + 1
            )
            t_back = await kubelet.wait_update(
                lambda s, p=probe: s.get(p) == "Healthy", timeout=5, since=since
            )
            backs.append((t_back - t_bad) * 1000)
        line("ListAndWatch update after an XID", flips, target=1000.0)
        line("  ... back to Healthy (quiet 200 ms)", backs)
        if wrong:
            print(f"error: {wrong} containers recorded more than once")
            return 1
        return 0
    finally:
        plugin.stop()
        await kubelet.stop()
        plane.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=300)
    parser.add_argument("--cards", type=int, default=8)
    parser.add_argument("--slots", type=int, default=40)
    parser.add_argument("--live", type=int, default=60)
    parser.add_argument("--flips", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tnp-bench-"))
    try:
        return asyncio.run(bench(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
