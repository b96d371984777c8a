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

from bench.bench_e2e import Result, cpu_by_process, cpu_spent, ratios, round_faults  # noqa: E402


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
