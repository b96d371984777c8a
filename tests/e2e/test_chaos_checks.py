"""The chaos run's plan and checks (e2e/chaos.py), on states made up here: each check finds
what it is there to find, and passes what is right. The run itself: tests/chaos/."""

from __future__ import annotations

import json

from e2e import chaos
from e2e.chaos import BindingView, PodView


def pod(name: str, node: str = "", devices: tuple[tuple[str, int, int], ...] = ()) -> PodView:
    allocation = ""
    if devices:
        record = {
            "containers": [
                {"devices": [{"uuid": u, "memory_mib": m, "cores": c} for u, m, c in devices]}
            ]
        }
        allocation = json.dumps(record)
    phase = "Running" if node else "Pending"
    return PodView(f"uid-{name}", "chaos-0", name, node, phase, allocation)


def binding(name: str, phase: str, node: str, *slices: tuple[str, int, int]) -> BindingView:
    return BindingView(f"uid-{name}", f"chaos-0/{name}", phase, node, tuple(sorted(slices)))


def test_the_same_seed_plans_the_same_run_and_every_round_has_every_fault() -> None:
    one, again, other = (chaos.make_plan(seed, 300, 15.0, 2) for seed in (7, 7, 8))
    assert one == again
    assert one != other
    kinds = [f.kind for f in one.faults]
    assert sorted(kinds) == sorted([*chaos.KILLS, *chaos.RESTARTS] * 2)
    assert all(0.05 * one.window_s <= f.at <= 0.9 * one.window_s for f in one.faults)
    assert [f.at for f in one.faults] == sorted(f.at for f in one.faults)
    deleted = [(p.at, p.delete_at) for p in one.pods if p.delete_at is not None]
    assert 0 < len(deleted) < len(one.pods) and all(gone > at for at, gone in deleted)
    assert {p.shape.pool for p in one.pods} == {"shared", "scarce"}


def test_over_allocation_is_anything_past_a_cards_memory_compute_or_slots() -> None:
    full = (chaos.CARD_MEMORY_MIB, chaos.CARD_CORES, chaos.CARD_SLOTS)
    assert chaos.over_allocated([("GPU-a", *full)]) == []
    for i, unit in enumerate((" MiB", "%", " slices")):
        memory, cores, slices = (n + (j == i) for j, n in enumerate(full))
        [found] = chaos.over_allocated([("GPU-a", memory, cores, slices)])
        assert found.startswith("GPU-a:") and f"{full[i] + 1}{unit} of {full[i]}" in found


def test_the_api_servers_view_sums_the_allocations_of_bound_pods_only() -> None:
    ended = pod("c", "n1", (("GPU-1", 9, 9),))
    pods = [
        pod("a", "n1", (("GPU-1", 40000, 50),)),
        pod("b", "n1", (("GPU-1", 50000, 60), ("GPU-2", 1000, 10))),
        PodView(ended.uid, ended.namespace, ended.name, "n1", "Succeeded", ended.allocation),
        pod("d"),
    ]
    usage = {u: (m, c, n) for u, m, c, n in chaos.api_usage(pods)}
    assert usage == {"GPU-1": (90000, 110, 2), "GPU-2": (1000, 10, 1)}
    assert [line.split(":")[0] for line in chaos.over_allocated(chaos.api_usage(pods))] == ["GPU-1"]


def test_the_ledger_and_the_api_server_agree_only_pod_for_pod() -> None:
    slices = ("GPU-1", 8192, 10)
    pods = {"uid-a": pod("a", "n1", (slices,)), "uid-w": pod("w")}
    ledger = {"uid-a": binding("a", "bound", "n1", slices), "uid-w": binding("w", "failed", "")}
    assert chaos.compare(pods, ledger) == []
    cases = {
        "pod gone": ({"uid-w": pods["uid-w"]}, ledger),
        "pod unbound": ({**pods, "uid-a": pod("a")}, ledger),
        "pod on n2": ({**pods, "uid-a": pod("a", "n2", (slices,))}, ledger),
        "still reserved": (pods, {**ledger, "uid-a": binding("a", "reserved", "n1", slices)}),
        "allocation": (pods, {**ledger, "uid-a": binding("a", "bound", "n1", ("GPU-2", 8192, 10))}),
        "ledger: failed": (pods, {**ledger, "uid-a": binding("a", "failed", "")}),
        "ledger: no binding": (pods, {"uid-w": ledger["uid-w"]}),
        "holds active slices": (pods, {**ledger, "uid-w": binding("w", "released", "", slices)}),
    }
    for words, (api, held) in cases.items():
        problems = chaos.compare(api, held)
        assert len(problems) == 1 and words in problems[0], (words, problems)


def test_a_pod_seen_on_two_nodes_or_with_two_allocations_was_bound_twice() -> None:
    mirror = chaos.Mirror(api=None)  # type: ignore[arg-type]
    for view in (pod("once"), pod("once", "n1", (("GPU-1", 1, 1),))):
        mirror.see(view)
    mirror.see(pod("moved", "n1", (("GPU-1", 1, 1),)))
    mirror.see(pod("moved", "n2", (("GPU-3", 1, 1),)))
    [twice] = mirror.twice_bound()
    assert twice.startswith("chaos-0/moved") and "n1" in twice and "n2" in twice


def test_every_failed_check_is_a_violation_and_names_what_failed() -> None:
    clean = chaos.Report(seed=1, planned=10, nodes=4)
    clean.samples.taken = 10
    assert clean.violations() == []
    broken = chaos.Report(seed=1, planned=10, nodes=4, lost=["chaos-0/p: pending, no why"])
    broken.samples.taken, broken.samples.missed = 10, 6
    broken.samples.note("ledger_over", 3.0, ["GPU-1: 90000 MiB of 81920"])
    found = broken.violations()
    assert any("chaos-0/p" in line for line in found)
    assert any("GPU-1" in line and "ledger" in line for line in found)
    assert any("4 of 10 samples" in line for line in found)
