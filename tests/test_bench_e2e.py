"""bench/bench_e2e.py: the checks it runs after every round, on made-up pods of each set-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_e2e import (  # noqa: E402
    Result,
    claim_steps,
    cpu_by_process,
    cpu_spent,
    goals,
    histogram_means,
    ratios,
    round_faults,
    scheduler_side,
)
from e2e import objects  # noqa: E402
from e2e.dra import (  # noqa: E402
    DeviceCapacity,
    device_capacities,
    kwok_slices,
    over_allocated_claims,
    shared_claim_template,
    with_claim_template,
)
from nodeplugin.dra_slices import DRIVER  # noqa: E402


def pod(name: str, node: str = "", **annotations: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "annotations": annotations}, "spec": {"nodeName": node}}


def hami_pod(name: str, card: str, memory: int = 1000, cores: int = 5) -> dict[str, Any]:
    value = f"{card},NVIDIA-A100,{memory},{cores}:;"
    return pod(name, "n1", **{"hami.io/vgpu-devices-allocated": value})


def tessera_pod(name: str, card: str, memory: int = 1000) -> dict[str, Any]:
    record = {"containers": [{"devices": [{"uuid": card, "memory_mib": memory, "cores": 5}]}]}
    return pod(name, "n1", **{"tessera.io/allocation": json.dumps(record)})


def test_a_card_past_its_ten_slots_is_found_from_hamis_annotation() -> None:
    pods = [hami_pod(f"p{i}", "GPU-a") for i in range(11)] + [hami_pod("q", "GPU-b")]
    cards, over, doubled, lost, pending = round_faults(
        pods, {p["metadata"]["name"] for p in pods}, {}
    )
    assert cards == 2
    assert len(over) == 1 and over[0].startswith("GPU-a:")
    assert (doubled, lost, pending) == ([], [], [])


def test_a_card_past_its_memory_is_found_from_tesseras_annotation() -> None:
    pods = [tessera_pod("p", "GPU-a", 81920), tessera_pod("q", "GPU-a", 1)]
    cards, over, _, _, _ = round_faults(pods, {"p", "q"}, {})
    assert cards == 1 and len(over) == 1
    cards, over, _, _, _ = round_faults(pods[:1], {"p"}, {})
    assert (cards, over) == (1, [])


def test_pods_bound_twice_lost_and_still_pending_are_named_apart() -> None:
    pods = [pod("bound", "n1"), pod("pending")]  # (a)/(b): no card is chosen
    cards, over, doubled, lost, pending = round_faults(
        pods, {"bound", "pending", "gone"}, {"bound": {"n1", "n2"}}
    )
    assert (cards, over) == (0, [])
    assert doubled == ["bound: ['n1', 'n2']"]
    assert lost == ["gone"]  # created, and no longer there unbound
    assert pending == ["pending"]  # there, not bound by the timeout: slow, not lost


def test_ratios_name_both_figures_and_leave_out_what_one_side_lacks() -> None:
    c = Result("(c)", 10, 10, 1.0, 9.0, 15.0, 50.0, backlog_bound=10, bursts=[0.8], cpu_s=0.3)
    d = Result("(d)", 10, 10, 1.0, 20.0, 2000.0, 0.5, backlog_bound=10, cpu_s=2.0)
    text = ratios(c, d)
    assert text.startswith("throughput 100 (50 against 0.5 pods/s)")
    assert "p99 0.0075 (15 against 2e+03 ms)" in text
    assert "CPU per pod 0.15 (30 against 200 ms)" in text
    assert "burst" not in text  # (d) measured none


def test_cpu_is_counted_per_component_by_the_session_each_was_started_in() -> None:
    busy = (
        "import time\nend = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\ntime.sleep(30)"
    )
    toy = subprocess.Popen([sys.executable, "-c", busy], start_new_session=True)
    try:
        cluster = SimpleNamespace(state={"components": {"toy": {"pid": toy.pid}}})
        before = cpu_by_process(cluster)  # type: ignore[arg-type]
        assert before[toy.pid][0] == "toy" and before[os.getpid()][0] == "bench"
        assert before[0][0] == "machine"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if cpu_by_process(cluster)[toy.pid][1] >= 0.25:  # type: ignore[arg-type]
                break
            time.sleep(0.05)
        spent = cpu_spent(before, cpu_by_process(cluster))  # type: ignore[arg-type]
        assert spent["toy"] >= 0.2
        assert spent["machine"] >= spent["toy"]
    finally:
        toy.kill()
        toy.wait()


# --- set-up (e), DRA mode: the checks over the claims' allocations, the goals --------------------


def allocated_claim(name: str, *results: tuple[str, str, str, str]) -> dict[str, Any]:
    """A claim as kube-scheduler leaves it: (pool, device, memory, compute) per result."""
    made = [
        dict(
            request="gpu",
            driver=DRIVER,
            pool=pool,
            device=device,
            shareID=f"{name}-{i}",
            consumedCapacity=dict(memory=memory, compute=compute, slots="1"),
        )
        for i, (pool, device, memory, compute) in enumerate(results)
    ]
    return {"metadata": {"name": name}, "status": {"allocation": {"devices": {"results": made}}}}


def published(node: str = "n1", cards: int = 2) -> dict[tuple[str, str], DeviceCapacity]:
    """The devices as the node plugin's builder publishes them (81920 MiB, 100 %, 10 slots)."""
    return device_capacities(kwok_slices(node, cards=cards, slots=10))


def test_the_published_devices_are_read_with_their_card_and_capacities() -> None:
    devices = published()
    assert devices[("n1", "gpu-1")] == DeviceCapacity("GPU-n1-1", 81920, 100, 10)
    assert len(devices) == 2
    exclusive = device_capacities(kwok_slices("n2", cards=1, modes={"0": "exclusive"}))
    assert exclusive[("n2", "gpu-0")].slots == 1  # one claim takes the card


def test_claims_within_a_card_pass_and_one_claim_past_its_memory_is_named() -> None:
    devices = published()
    fits = [allocated_claim(f"c{i}", ("n1", "gpu-0", "40Gi", "50")) for i in range(2)]
    assert over_allocated_claims(fits, devices) == (1, [])
    over = [*fits, allocated_claim("c2", ("n1", "gpu-0", "1Mi", "0"))]
    cards, found = over_allocated_claims(over, devices)
    assert cards == 1
    assert found == ["GPU-n1-0 (n1/gpu-0): 81921 MiB of 81920, 100% of 100, 3 slots of 10"]


def test_compute_and_slots_past_the_card_are_named_and_other_drivers_are_not_counted() -> None:
    devices = published()
    compute = [allocated_claim(f"c{i}", ("n1", "gpu-1", "1000Mi", "40")) for i in range(3)]
    assert over_allocated_claims(compute, devices)[1] == [
        "GPU-n1-1 (n1/gpu-1): 3000 MiB of 81920, 120% of 100, 3 slots of 10"
    ]
    slots = [allocated_claim(f"s{i}", ("n1", "gpu-0", "1000Mi", "5")) for i in range(11)]
    assert "11 slots of 10" in over_allocated_claims(slots, devices)[1][0]
    theirs = allocated_claim("x", ("n1", "gpu-0", "90Gi", "100"))
    theirs["status"]["allocation"]["devices"]["results"][0]["driver"] = "gpu.nvidia.com"
    assert over_allocated_claims([theirs], devices) == (0, [])


def test_a_device_allocated_and_not_published_is_a_fault_and_pending_claims_are_not() -> None:
    devices = published()
    ghost = allocated_claim("g", ("n9", "gpu-0", "1Gi", "5"))
    pending: dict[str, Any] = {"metadata": {"name": "p"}, "status": {}}
    assert over_allocated_claims([ghost, pending], devices) == (
        1,
        ["n9/gpu-0: allocated, and in no published slice"],
    )


def test_the_claim_template_asks_one_shared_device_of_c_s_slice_and_the_pod_points_at_it() -> None:
    template = shared_claim_template("t", 1000, 5)
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {
        "deviceClassName": DRIVER,
        "capacity": {"requests": {"memory": "1000Mi", "compute": "5"}},
    }
    pod = with_claim_template(objects.gpu_pod("p", gpumem=1000, gpucores=5), "t")
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "t"}]
    (container,) = pod["spec"]["containers"]
    assert container["resources"] == {"claims": [{"name": "gpu"}]}  # no extended resources left


def result(label: str, pods_per_s: float, p99_ms: float) -> Result:
    return Result(label, 10, 10, 1.0, p99_ms / 2, p99_ms, pods_per_s, backlog_bound=10)


def test_the_goals_are_met_or_missed_against_a_and_c_is_only_compared() -> None:
    a, c = result("(a)", 100.0, 200.0), result("(c)", 40.0, 900.0)
    meets = goals(result("(e)", 70.0, 300.0), a, c)
    assert meets == [
        "(e)/(a) throughput: 0.70 (70.0 against 100.0 pods/s) (meets the 0.7 goal)",
        "(e)/(a) p99 latency: 1.50 (300 against 200 ms) (meets the 1.5 goal)",
        "(e)/(c) throughput: 1.75 (70.0 against 40.0 pods/s)",
        "(e)/(c) p99 latency: 0.33 (300 against 900 ms)",
    ]
    misses = goals(result("(e)", 69.0, 301.0), a, None)
    assert [line.rsplit("(", 1)[1] for line in misses] == [
        "MISSES the 0.7 goal)",
        "MISSES the 1.5 goal)",
    ]
    assert goals(result("(e)", 69.0, 301.0), None, None) == []


def test_histogram_means_sum_a_label_s_series_and_keep_only_the_plugin_asked() -> None:
    family = "scheduler_plugin_execution_duration_seconds"
    series = [  # (part, extension point, plugin, status, value)
        ("sum", "Filter", "DynamicResources", "Success", 0.3),
        ("count", "Filter", "DynamicResources", "Success", 2),
        ("sum", "Filter", "DynamicResources", "Error", 0.1),
        ("count", "Filter", "DynamicResources", "Error", 2),
        ("sum", "Filter", "NodeName", "Success", 9),
        ("count", "Filter", "NodeName", "Success", 1),
        ("count", "Score", "DynamicResources", "Success", 0),
        ("bucket", "Filter", "DynamicResources", "Success", 4),
    ]
    text = "\n".join(
        f'{family}_{part}{{extension_point="{point}",plugin="{plugin}",status="{status}"}} {n}'
        for part, point, plugin, status, n in series
    )
    means = histogram_means(text, family, "extension_point", 'plugin="DynamicResources"')
    assert means == {"Filter": (4, 100.0)}  # 0.4 s over 4 calls; Score never observed
    assert histogram_means(text, family, "extension_point")["Filter"] == (5, 1880.0)


def test_claim_steps_split_a_dra_pod_s_time_and_leave_out_pods_not_seen_through() -> None:
    created = {"p": 10.0, "q": 20.0, "r": 30.0}
    made = {"p": 10.1, "q": 20.3, "r": 30.1}
    allocated = {"p": 10.6, "q": 20.4}  # r's claim never allocated: left out
    bound = {"p": 10.7, "q": 21.4}
    text = claim_steps(["p", "q", "r"], created, made, allocated, bound)
    assert text == (
        "p50 / p99 of each step, over 2 pods: created, claim made +200 / +300 ms, "
        "claim allocated +300 / +500 ms, pod bound +550 / +1000 ms"
    )
    assert claim_steps(["r"], created, made, allocated, bound) == "no pod seen through every step"
    protected = {"p": 10.5, "q": 20.35}  # PreBind's first write: splits the allocation step
    assert claim_steps(["p", "q"], created, made, allocated, bound, protected) == (
        "p50 / p99 of each step, over 2 pods: created, claim made +200 / +300 ms, "
        "claim protected +225 / +400 ms, claim allocated +75 / +100 ms, pod bound +550 / +1000 ms"
    )


def test_scheduler_side_cpu_is_per_pod_for_the_processes_that_ran_only() -> None:
    spent = {"kube-scheduler": 0.8, "resourceclaim-controller": 0.3, "kube-apiserver": 1.5}
    assert scheduler_side(spent, 100) == (
        "kube-scheduler 8.0 ms, resourceclaim-controller 3.0 ms"  # the API server is not one
    )
    assert scheduler_side({"kube-apiserver": 1.0}, 100) == "none measured"
