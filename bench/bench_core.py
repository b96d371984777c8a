"""Benchmark of the scheduling core's hot path: filter + prioritize over a whole cluster.

Run: ``python bench/bench_core.py [--nodes 1000] [--slices 20000] [--pods 300] [--repeat 3]``

Builds a seeded cluster of mixed nodes (8 cards each: 80, 40 or 24 GiB, 10 slots), places
random slices on it the way the ledger would, then times ``filter_nodes`` over every node
plus ``prioritize`` over the feasible ones, for two kinds of pod. Each pod is timed
``--repeat`` times: the first wall-clock timing is what a server sees (other tenants of a
shared machine included); the best one, and the thread's CPU time, are the cost of the
code. It also prints the cost of reading every failed node's reason (what the extender's
FailedNodes needs), the first time and when kube-scheduler asks again about the same pod,
parse_pod and place_on_node, so no part of an extender call hides outside the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.scheduling import (
    CardState,
    ContainerRequest,
    NodeState,
    PodRequest,
    Snapshot,
    filter_nodes,
    parse_pod,
    place_on_node,
    prioritize,
)

MODELS = (
    ("NVIDIA A100-SXM4-80GB", 81920),
    ("NVIDIA A100-PCIE-40GB", 40960),
    ("NVIDIA L4", 24576),
)
CORES = (0, 0, 0, 0, 10, 20, 25, 30, 50)


def build_cluster(n_nodes: int, n_slices: int, rng: random.Random) -> tuple[Any, float]:
    """Raw per-card usage, then the Snapshot; returns (snapshot, build seconds)."""
    cards: list[list[dict[str, Any]]] = []
    for n in range(n_nodes):
        model, mem = MODELS[n % len(MODELS)] if rng.random() < 0.9 else rng.choice(MODELS)
        cards.append(
            [
                {
                    "uuid": f"GPU-{n:04d}-{i}",
                    "model": model,
                    "memory": mem,
                    "used_mem": 0,
                    "used_cu": 0,
                    "used_slots": 0,
                    "exclusive": False,
                    "healthy": rng.random() > 0.01,
                }
                for i in range(8)
            ]
        )
    placed = 0
    attempts = 0
    while placed < n_slices and attempts < n_slices * 20:
        attempts += 1
        card = rng.choice(rng.choice(cards))
        want_mem = rng.choice((1024, 2048, 4096, 4096, 8192, 8192, 12288, 16384))
        want_cu = 100 if rng.random() < 0.01 else rng.choice(CORES)
        if card["exclusive"] or card["used_slots"] >= 10:
            continue
        if want_cu == 100 and card["used_slots"]:
            continue
        if card["used_mem"] + want_mem > card["memory"] or card["used_cu"] + want_cu > 100:
            continue
        card["used_mem"] += want_mem
        card["used_cu"] += want_cu
        card["used_slots"] += 1
        card["exclusive"] = card["exclusive"] or want_cu == 100
        placed += 1

    start = time.perf_counter_ns()
    nodes = []
    for n, node_cards in enumerate(cards):
        nodes.append(
            NodeState(
                name=f"node-{n:04d}",
                ready=rng.random() > 0.01,
                cordoned=rng.random() < 0.01,
                cards=tuple(
                    CardState(
                        uuid=c["uuid"],
                        index=i,
                        model=c["model"],
                        memory_mib=c["memory"],
                        compute_units=100,
                        slots=10,
                        numa_node=i // 4,
                        healthy=c["healthy"],
                        health_reason="" if c["healthy"] else "XID 79",
                        cordoned=False,
                        used_memory_mib=c["used_mem"],
                        used_compute=c["used_cu"],
                        used_slots=c["used_slots"],
                        exclusive=c["exclusive"],
                    )
                    for i, c in enumerate(node_cards)
                ),
            )
        )
    snapshot = Snapshot.build(nodes)
    build_s = (time.perf_counter_ns() - start) / 1e9
    print(f"placed {placed} slices in {attempts} attempts")
    return snapshot, build_s


def one_gpu_pod(rng: random.Random, i: int) -> PodRequest:
    """One container, one slice, random memory (sometimes a percentage) and compute."""
    pct = rng.random() < 0.15
    return PodRequest(
        uid=f"uid-a-{i}",
        namespace="bench",
        name=f"a-{i}",
        containers=(
            ContainerRequest(
                name="main",
                index=0,
                init=False,
                gpus=1,
                memory_mib=None if pct else rng.randrange(1024, 40960, 512),
                memory_percent=rng.choice((10, 25, 50)) if pct else None,
                cores=rng.choice(CORES),
            ),
        ),
        node_policy=rng.choice(("binpack", "spread")),
        gpu_policy=rng.choice(("binpack", "spread")),
    )


def four_by_two_pod(rng: random.Random, i: int) -> PodRequest:
    """Four containers of two slices each, random memory and compute per container."""
    return PodRequest(
        uid=f"uid-b-{i}",
        namespace="bench",
        name=f"b-{i}",
        containers=tuple(
            ContainerRequest(
                name=f"c{k}",
                index=k,
                init=False,
                gpus=2,
                memory_mib=rng.randrange(1024, 12288, 512),
                memory_percent=None,
                cores=rng.choice(CORES),
            )
            for k in range(4)
        ),
        node_policy=rng.choice(("binpack", "spread")),
        gpu_policy=rng.choice(("binpack", "spread")),
    )


def typed_pod(rng: random.Random, i: int) -> PodRequest:
    """A one-slice pod that only runs on A100s (nvidia.com/use-gputype: a100)."""
    return dataclasses.replace(one_gpu_pod(rng, i), use_types=("a100",))


def pod_json(request: PodRequest) -> dict[str, Any]:
    """A Kubernetes Pod for parse_pod timing, equivalent to ``request``."""
    containers = []
    for c in request.containers:
        limits: dict[str, Any] = {"nvidia.com/gpu": str(c.gpus), "nvidia.com/gpucores": c.cores}
        if c.memory_mib is not None:
            limits["nvidia.com/gpumem"] = str(c.memory_mib)
        elif c.memory_percent is not None:
            limits["nvidia.com/gpumem-percentage"] = str(c.memory_percent)
        containers.append({"name": c.name, "image": "x", "resources": {"limits": limits}})
    return {
        "metadata": {
            "name": request.name,
            "namespace": request.namespace,
            "uid": request.uid,
            "annotations": {
                "hami.io/node-scheduler-policy": request.node_policy,
                "tessera.io/gpu-policy": request.gpu_policy,
                **(
                    {"nvidia.com/use-gputype": ",".join(request.use_types)}
                    if request.use_types
                    else {}
                ),
            },
        },
        "spec": {"containers": containers},
    }


def percentiles(samples_ns: list[int]) -> str:
    ms = sorted(s / 1e6 for s in samples_ns)

    def at(q: float) -> float:
        return ms[min(len(ms) - 1, int(q * len(ms)))]

    return f"median {statistics.median(ms):7.3f}  p90 {at(0.90):7.3f}  p99 {at(0.99):7.3f} ms"


def run_kind(
    label: str, snapshot: Snapshot, make: Callable[[random.Random, int], PodRequest], args: Any
) -> None:
    rng = random.Random(args.seed + sum(map(ord, label)))
    names = [n.name for n in snapshot.nodes]
    pods = [make(rng, i) for i in range(args.pods)]
    # Warm up (imports, caches of the interpreter), not measured.
    for pod in pods[:10]:
        filter_nodes(snapshot, pod, names)
    first: list[int] = []  # the first timing of each pod, as a server would see it
    best: list[int] = []  # each pod's best of --repeat, which filters out other tenants
    cpu: list[int] = []  # each pod's least CPU time of the thread (waits for a core excluded)
    full: list[int] = []
    retry: list[int] = []
    parse: list[int] = []
    bind: list[int] = []
    feasible_counts: list[int] = []
    for pod in pods:
        times = []
        cpu_times = []
        for _ in range(args.repeat):
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            feasible, failed = filter_nodes(snapshot, pod, names)
            prioritize(snapshot, pod, feasible)
            times.append(time.perf_counter_ns() - t0)
            cpu_times.append(time.thread_time_ns() - c0)
        first.append(times[0])
        best.append(min(times))
        cpu.append(min(cpu_times))
        # What the extender also needs: a reason and the permanence of every failed node; then
        # the same again, as when kube-scheduler asks about a pod it could not place.
        for into in (full, retry):
            t0 = time.perf_counter_ns()
            feasible, failed = filter_nodes(snapshot, pod, names)
            prioritize(snapshot, pod, feasible)
            for fit in failed:
                fit.summary()
                _ = fit.permanent
            into.append(time.perf_counter_ns() - t0)
        feasible_counts.append(len(feasible))
        raw = pod_json(pod)
        t2 = time.perf_counter_ns()
        parse_pod(raw)
        parse.append(time.perf_counter_ns() - t2)
        if feasible:
            node = snapshot.by_name[feasible[0]]
            t3 = time.perf_counter_ns()
            place_on_node(node, pod)
            bind.append(time.perf_counter_ns() - t3)
    counts = sorted(feasible_counts)
    print(f"\n== {label}: {len(pods)} pods against {len(names)} nodes")
    print(f"  filter+prioritize, first run     {percentiles(first)}")
    print(f"  filter+prioritize, best of {args.repeat}     {percentiles(best)}")
    print(f"  filter+prioritize, CPU time      {percentiles(cpu)}")
    print(f"  ... + every failed node's reason {percentiles(full)}")
    print(f"  ... the same pod again (a retry) {percentiles(retry)}")
    print(f"  parse_pod                        {percentiles(parse)}")
    if bind:
        print(f"  place_on_node (one node)         {percentiles(bind)}")
    print(
        f"  feasible nodes: median {statistics.median(counts):.0f}, "
        f"min {counts[0]}, max {counts[-1]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--slices", type=int, default=20000)
    parser.add_argument("--pods", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=3, help="timings per pod (>= 1)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    rng = random.Random(args.seed)
    snapshot, build_s = build_cluster(args.nodes, args.slices, rng)
    print(
        f"snapshot: {args.nodes} nodes x 8 cards, build {build_s * 1000:.1f} ms "
        "(CardState/NodeState construction with precomputation, and the index)"
    )
    run_kind("one container, one GPU", snapshot, one_gpu_pod, args)
    run_kind("4 containers x 2 GPUs", snapshot, four_by_two_pod, args)
    run_kind("one GPU, use-gputype a100", snapshot, typed_pod, args)


if __name__ == "__main__":
    main()
