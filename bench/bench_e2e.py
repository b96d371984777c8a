"""Scheduling at scale on a real cluster: kube-scheduler alone, with a no-op extender, with Tessera.

    .venv/bin/python bench/bench_e2e.py [--nodes 1000] [--cards 8] [--pods 5000]
                                        [--only a,b,c,d,e] [--rounds 2]

One harness cluster (e2e/cluster.py: etcd, kube-apiserver, kwok, the control plane) with
`--nodes` kwok GPU nodes of `--cards` cards each, their inventory reported to Tessera. Then the
same kube-scheduler binary and profile (`tessera-scheduler`) is run three times, each on
`--pods` fresh pods asking for one slice:

  (a) no extender at all;
  (b) a no-op extender (e2e/noop_extender.py) configured exactly like Tessera: filter keeps every
      node, prioritize scores 0, bind creates the Binding — the cost of "an extender at all";
  (c) Tessera's extender and its admission webhook;
  (d) HAMi's scheduler extender and its own kube-scheduler (e2e/hami.py), configured from HAMi's
      own chart, the kwok nodes' cards registered in the node annotation HAMi's device plugin
      writes, and the plugin's part after a bind (allocate, release HAMi's node lock) done the
      moment the binding shows (e2e/hami_plugin.py: HAMi's best case); run twice, with HAMi's
      API client as shipped (5 requests/s, burst 10) and raised (key `dr`; `--only d` runs
      both). e2e/build.sh builds HAMi's scheduler from its source tarball in shared/peers/hami/
      beside the checkout (e2e/versions.env says why the Go module proxy cannot serve it);
      without the tarball the run says that (d) was left out;
  (e) DRA mode (docs/dra.md): no extender, kube-scheduler's default profile allocating from the
      ResourceSlices the node plugin would publish for every kwok node's cards (e2e/dra.py, the
      plugin's own builder), the chart's DeviceClasses, kube-controller-manager's ResourceClaim
      controller making each pod's claim from a ResourceClaimTemplate of the namespace (one
      device of Tessera's shared class, the same 1000 MiB and 5 % as (c)'s slice), Tessera's
      webhook and reconciler on, restarted with TESSERA_MODE=dra for (e)'s rounds. Its checks
      read kube-scheduler's own record, the claims' allocations. It cannot be left out
      quietly: without its gates, controller or slices the run stops with the reason.

For each: throughput, pods/s, from a backlog (`--pods` pods created while no scheduler runs,
then the scheduler starts: pods / (last binding - scheduler start); creating pods from Python is
slower than kube-scheduler, so pods created while it runs would measure the client), and
latency, p50/p99 from a pod's creation (the create call returning) to its binding (seen on a
watch), over a paced stream (`--paced` pods at `--rate` pods/s) while it runs; for (c) and (d),
then a burst: `--burst` pods created at once onto `--burst-nodes` nodes, seconds until all are
bound. After every round, its checks: cards over their memory, compute or slots, pods bound
twice, pods lost (pods still pending at the timeout are counted apart: slow, not lost). Then
the ratios (c)/(b), (c)/(a) of throughput, (c)/(b) of p99 latency, (c)/(d) of throughput,
p50, p99, CPU per pod and the burst, and (e)/(a), (e)/(c) of throughput and p99 against DRA
mode's goals (docs/e2e.md, *Set-up (e)*). Each round
prints the machine's load averages before its backlog and the CPU the machine spent outside the
harness during it (`other`), so a round run on a busy machine shows as one. Each set-up gets a
fresh namespace; a set-up's pods are deleted (and the cluster left to settle) before the next
one, so each starts on empty nodes.

`--rounds` (default 2) splits each set-up's pods into that many backlogs (and paced streams),
run in the order a b c d e, then e d c b a, and so on; a set-up's throughput is all its backlog pods
over all its backlog time. The machine's speed drifts over a run of several minutes (on a shared
machine by a fifth between one set-up and the next), and the mirrored order gives every set-up
the same share of early and late. `--rounds 1` runs each set-up once, as before.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests
import urllib3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_extender import settings_from
from e2e import objects
from e2e.chaos import over_allocated, pod_view
from e2e.cluster import Cluster, Options
from e2e.database import ScratchDatabase
from e2e.dra import (
    CLAIM_CONTROLLER,
    FEATURE_GATES,
    RESOURCE_API,
    DeviceCapacity,
    apply_device_classes,
    device_capacities,
    over_allocated_claims,
    publish_kwok_slices,
    register_claim_webhook,
    shared_claim_template,
    start_claim_controller,
    with_claim_template,
)
from e2e.hami import ALLOCATED_ANNOTATION, RAISED, SHIPPED, Hami, allocated_devices
from e2e.hami import binaries as hami_binaries
from e2e.harness import ROOT, HarnessError, build_binaries, run_folder
from e2e.objects import Api
from tests.deploy.chart import render

# DRA mode's goals against kube-scheduler alone (a): throughput at least this share of its,
# p99 creation-to-bound at most this multiple of its.
DRA_THROUGHPUT_GOAL = 0.7
DRA_P99_GOAL = 1.5

BURST_LABEL = "tessera.io/e2e-burst"  # the nodes the burst's pods are kept on


@dataclass
class Result:
    label: str
    pods: int
    bound: int
    seconds: float
    p50_ms: float
    p99_ms: float
    throughput: float
    backlog_bound: int = 0  # of the backlog's pods (`bound` counts the paced ones too)
    latencies: list[float] = field(default_factory=list)  # the paced stream's, sorted
    bursts: list[float] = field(default_factory=list)  # seconds until a burst was all bound
    faults: int = 0  # cards over their memory or slots, pods bound twice, pods lost
    cpu_s: float = 0.0  # the machine's CPU seconds over the backlog

    @property
    def cpu_ms_per_pod(self) -> float:
        return 1000 * self.cpu_s / max(self.backlog_bound, 1)

    @property
    def burst_s(self) -> float:
        """Mean seconds until a burst was all bound (0: none measured)."""
        return statistics.mean(self.bursts) if self.bursts else 0.0

    @property
    def pods_per_s(self) -> float:
        return self.throughput


def _percentiles(latencies: list[float]) -> tuple[float, float]:
    if not latencies:
        return 0.0, 0.0
    return statistics.median(latencies), latencies[
        min(len(latencies) - 1, int(len(latencies) * 0.99))
    ]


def combine(label: str, rounds: list[Result]) -> Result:
    """One set-up's rounds as one result: all its backlog pods over all its backlog time, the
    percentiles of all its paced pods."""
    latencies = sorted(ms for r in rounds for ms in r.latencies)
    p50, p99 = _percentiles(latencies)
    seconds = sum(r.seconds for r in rounds)
    backlog = sum(r.backlog_bound for r in rounds)
    return Result(
        label=label,
        pods=sum(r.pods for r in rounds),
        bound=sum(r.bound for r in rounds),
        seconds=seconds,
        p50_ms=p50,
        p99_ms=p99,
        throughput=backlog / seconds if seconds > 0 else 0.0,
        backlog_bound=backlog,
        latencies=latencies,
        bursts=[b for r in rounds for b in r.bursts],
        faults=sum(r.faults for r in rounds),
        cpu_s=sum(r.cpu_s for r in rounds),
    )


def ratios(c: Result, d: Result) -> str:
    """(c)/(d) of each figure both have: throughput (higher is better for (c) above 1), p50 and
    p99 latency, CPU per pod and the burst's time (lower is better for (c) below 1)."""
    pairs = [
        ("throughput", c.pods_per_s, d.pods_per_s, "pods/s"),
        ("p50", c.p50_ms, d.p50_ms, "ms"),
        ("p99", c.p99_ms, d.p99_ms, "ms"),
        ("CPU per pod", c.cpu_ms_per_pod, d.cpu_ms_per_pod, "ms"),
        ("burst", c.burst_s, d.burst_s, "s"),
    ]
    return ", ".join(
        f"{what} {mine / theirs:.3g} ({mine:.3g} against {theirs:.3g} {unit})"
        for what, mine, theirs, unit in pairs
        if mine and theirs
    )


def label_burst_nodes(api: Api, names: list[str]) -> None:
    """Label the nodes the burst's pods are kept on (their other labels stay, so every set-up's
    backlog and stream still use all the nodes)."""
    for name in names:
        response = api.session().patch(
            f"{api.base}/api/v1/nodes/{name}",
            data=json.dumps({"metadata": {"labels": {BURST_LABEL: "true"}}}),
            headers={"Content-Type": "application/merge-patch+json"},
            timeout=60,
        )
        response.raise_for_status()


@dataclass(frozen=True)
class Dra:
    """What (e) brings beyond the cluster: the claim controller's binary and the devices the
    kwok nodes publish (kube-scheduler's capacity of each, for the checks)."""

    controller: Path
    devices: dict[tuple[str, str], DeviceCapacity]
    qps: int | None = None  # the claim controller's client (None: its own default, 20/s)
    # (c)'s slice, as a claim asks it: one device of the shared class, 1000 MiB and 5 %.
    template: str = "gpu-1000mi-5pct"
    memory_mib: int = 1000
    compute: int = 5


def prepare_dra(
    cluster: Cluster,
    api: Api,
    nodes: list[str],
    cards: int,
    workers: int,
    controller: Path,
    qps: int | None,
) -> Dra:
    """The chart's DeviceClasses and its claim webhook (Tessera's quotas on claims and on pods
    naming templates, called for every (e) pod and claim as in a DRA-mode deployment), and every
    kwok node's ResourceSlices, read back as the API server stores them. Fails with the reason
    when the API server kept fewer devices than were published (a gate off: a shared card stored
    without its capacities is not Tessera's)."""
    started = time.monotonic()
    docs = render(sets=("mode=dra",))
    classes = apply_device_classes(api, docs)
    register_claim_webhook(cluster, api, docs)
    published = publish_kwok_slices(api, nodes, cards=cards, workers=workers)
    stored = api.get(f"{RESOURCE_API}/resourceslices")["items"]
    devices = device_capacities(stored)
    shared = [d for d in devices.values() if d.slots > 1]
    if len(shared) != len(nodes) * cards:
        raise HarnessError(
            f"(e): {published} ResourceSlices published for {len(nodes)} nodes x {cards} cards, "
            f"and the API server holds {len(shared)} shared devices with slots: are the gates "
            f"{FEATURE_GATES} on in kube-apiserver?"
        )
    print(
        f"# (e): DeviceClasses {', '.join(classes)}, the claim webhook; {published} "
        f"ResourceSlices, "
        f"{len(shared)} shared devices, in {time.monotonic() - started:.0f} s",
        flush=True,
    )
    return Dra(controller=controller, devices=devices, qps=qps)


def claims_of(api: Api, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = api.get(f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims")[
        "items"
    ]
    return items


def clean_up_claims(api: Api, namespace: str, timeout: float, workers: int) -> None:
    """After (e)'s pods are gone, delete their claims and wait until they are gone, so the next
    set-up starts on devices with nothing consumed. A claim made from a template is owned by its
    pod, and in a cluster kube-controller-manager's garbage collector deletes it after the pod;
    the harness runs no garbage collector, so the round deletes them itself, one DELETE per
    claim from a thread pool as `clean_up` deletes pods (one delete-collection of thousands
    could run past the request's timeout). The claim controller, still running, frees each
    deleted claim's allocation and lifts its finalizer."""
    path = f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims"

    def delete(name: str) -> None:
        response = api.session().delete(f"{api.base}{path}/{name}", timeout=60)
        if response.status_code not in (200, 202, 404):
            response.raise_for_status()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        items = claims_of(api, namespace)
        if not items:
            return
        names = [c["metadata"]["name"] for c in items if not c["metadata"].get("deletionTimestamp")]
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(delete, names))
        time.sleep(1)
    raise RuntimeError(f"the claims of {namespace} were not gone within {timeout:.0f} s")


def dra_plugin_times(cluster: Cluster, port: int) -> str:
    """Mean time of kube-scheduler's DynamicResources plugin per extension point, from its
    /metrics (`scheduler_plugin_execution_duration_seconds`, sampled by the scheduler): the
    allocator's share of the scheduling cycle in (e)."""
    text = scheduler_metrics(cluster, port)
    if text is None:
        return "(no kube-scheduler metrics)"
    family = "scheduler_plugin_execution_duration_seconds"
    means = histogram_means(text, family, "extension_point", 'plugin="DynamicResources"')
    parts = [f"{point} {ms:.2f} ms ({n} sampled)" for point, (n, ms) in means.items()]
    return "DynamicResources plugin, mean per call: " + (", ".join(parts) or "none sampled")


def goals(e: Result, a: Result | None, c: Result | None) -> list[str]:
    """(e)/(a) and (e)/(c) of throughput and p99 latency; against (a), DRA mode's goals, each
    marked "meets" or "MISSES"."""
    lines = []
    for other, key in ((a, "a"), (c, "c")):
        if other is None:
            continue
        if other.pods_per_s:
            ratio = e.pods_per_s / other.pods_per_s
            verdict = ""
            if key == "a":
                met = "meets" if ratio >= DRA_THROUGHPUT_GOAL else "MISSES"
                verdict = f" ({met} the {DRA_THROUGHPUT_GOAL:g} goal)"
            lines.append(
                f"(e)/({key}) throughput: {ratio:.2f} ({e.pods_per_s:.1f} against "
                f"{other.pods_per_s:.1f} pods/s){verdict}"
            )
        if other.p99_ms:
            ratio = e.p99_ms / other.p99_ms
            verdict = ""
            if key == "a":
                met = "meets" if ratio <= DRA_P99_GOAL else "MISSES"
                verdict = f" ({met} the {DRA_P99_GOAL:g} goal)"
            lines.append(
                f"(e)/({key}) p99 latency: {ratio:.2f} ({e.p99_ms:.0f} against "
                f"{other.p99_ms:.0f} ms){verdict}"
            )
    return lines


def pod_devices(raw: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(card UUID, MiB, cores %) of each device a bound pod was given: Tessera's allocation
    annotation, or HAMi's; none for a pod that only kube-scheduler placed ((a), (b))."""
    annotations = (raw.get("metadata") or {}).get("annotations") or {}
    if ALLOCATED_ANNOTATION in annotations:
        return allocated_devices(annotations[ALLOCATED_ANNOTATION])
    return pod_view(raw).devices()


def round_faults(
    pods: list[dict[str, Any]], created: set[str], nodes_seen: dict[str, set[str]]
) -> tuple[int, list[str], list[str], list[str], list[str]]:
    """After a set-up's round, from its namespace's `pods`: how many cards its bound pods were
    given devices on (none in (a) and (b), where no card is chosen), the cards over their memory,
    compute or slots by those devices, the pods bound twice (seen on two nodes), the pods lost
    (created, and gone without being bound) and the pods still pending (not bound by the
    round's timeout: slow, not a fault)."""
    totals: dict[str, list[int]] = {}
    bound = set()
    listed = set()
    for raw in pods:
        listed.add(raw["metadata"]["name"])
        if not (raw.get("spec") or {}).get("nodeName"):
            continue
        bound.add(raw["metadata"]["name"])
        for uuid, memory, cores in pod_devices(raw):
            total = totals.setdefault(uuid, [0, 0, 0])
            total[0], total[1], total[2] = total[0] + memory, total[1] + cores, total[2] + 1
    over = over_allocated((uuid, m, c, n) for uuid, (m, c, n) in totals.items())
    doubled = sorted(f"{n}: {sorted(nodes)}" for n, nodes in nodes_seen.items() if len(nodes) > 1)
    lost = sorted(created - listed)
    pending = sorted((created & listed) - bound)
    return len(totals), over, doubled, lost, pending


def setup_nodes(
    cluster: Cluster, api: Api, nodes: int, cards: int, workers: int
) -> dict[str, dict[str, Any]]:
    """Create the kwok nodes and report their cards to Tessera; returns each node's inventory."""
    names = [f"kwok-gpu-{i:04d}" for i in range(nodes)]
    tessera = objects.Tessera(cluster.controlplane_url, cluster.admin_token)
    started = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda n: api.post("/api/v1/nodes", objects.gpu_node(n, cards=cards)), names))

    def report(name: str) -> None:
        # The admin identity may report any node: 1,000 node tokens would only cost set-up time.
        resp = tessera.report_inventory(name, objects.inventory(name, cards=cards))
        if resp.status_code not in (200, 201):
            raise RuntimeError(f"inventory {name}: {resp.status_code} {resp.text[:300]}")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(report, names))

    def ready() -> bool:
        items = api.get("/api/v1/nodes?labelSelector=type%3Dkwok")["items"]
        count = 0
        for node in items:
            conditions = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}
            count += conditions.get("Ready") == "True"
        return count == nodes

    objects.wait_for(ready, timeout=600, what=f"{nodes} kwok nodes Ready", every=2)
    print(
        f"# {nodes} nodes x {cards} cards ready in {time.monotonic() - started:.0f} s", flush=True
    )
    return {name: objects.inventory(name, cards=cards) for name in names}


def watch_bindings(
    api: Api,
    namespace: str,
    resource_version: str,
    bound: dict[str, float],
    nodes_seen: dict[str, set[str]],
    stop: threading.Event,
) -> None:
    """Record when each pod is first seen bound, and every node it is seen on."""
    path = (
        f"/api/v1/namespaces/{namespace}/pods?watch=true"
        f"&resourceVersion={resource_version}&timeoutSeconds=3600"
    )
    try:
        for event in api.events(path, stop, timeout=(10, 3600)):
            pod = event.get("object", {})
            name = pod.get("metadata", {}).get("name")
            node = pod.get("spec", {}).get("nodeName")
            if name and node:
                nodes_seen.setdefault(name, set()).add(node)
                if name not in bound:
                    bound[name] = time.monotonic()
    except requests.RequestException:
        if not stop.is_set():
            raise  # the watch broke mid-phase: the figures would be wrong


def watch_claims(
    api: Api,
    namespace: str,
    resource_version: str,
    made: dict[str, float],
    allocated: dict[str, float],
    stop: threading.Event,
    protected: dict[str, float] | None = None,
) -> None:
    """(e): record, by the pod each claim was made for (its owner), when the claim is first
    seen (the claim controller made it), first seen with a finalizer (`protected`: the first of
    kube-scheduler's two writes in PreBind, after its scheduling cycle chose the device) and
    first seen allocated (PreBind's second write, the claim's status): where a DRA pod's time
    between creation and binding goes."""
    path = (
        f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims?watch=true"
        f"&resourceVersion={resource_version}&timeoutSeconds=3600"
    )
    try:
        for event in api.events(path, stop, timeout=(10, 3600)):
            claim = event.get("object", {})
            owners = claim.get("metadata", {}).get("ownerReferences") or []
            pods = [o["name"] for o in owners if o.get("kind") == "Pod"]
            if not pods:
                continue
            now = time.monotonic()
            made.setdefault(pods[0], now)
            if protected is not None and claim["metadata"].get("finalizers"):
                protected.setdefault(pods[0], now)
            if (claim.get("status") or {}).get("allocation"):
                allocated.setdefault(pods[0], now)
    except requests.RequestException:
        if not stop.is_set():
            raise


def claim_steps(
    pods: list[str],
    created: dict[str, float],
    made: dict[str, float],
    allocated: dict[str, float],
    bound: dict[str, float],
    protected: dict[str, float] | None = None,
) -> str:
    """p50/p99 of each step of the `pods` seen through all of them: created -> claim made (the
    claim controller), [-> claim protected (kube-scheduler's queue and cycle, PreBind's first
    write),] -> claim allocated (PreBind's status write), -> pod bound (the binding)."""
    marks = [("claim made", made), ("claim allocated", allocated), ("pod bound", bound)]
    if protected is not None:
        marks.insert(1, ("claim protected", protected))
    seen = [p for p in pods if p in created and all(p in d for _, d in marks)]
    if not seen:
        return "no pod seen through every step"
    steps = [
        (what, since, until)
        for (what, until), since in zip(marks, [created, *(d for _, d in marks)], strict=False)
    ]
    parts = []
    for what, since, until in steps:
        p50, p99 = _percentiles(sorted(1000 * max(0.0, until[p] - since[p]) for p in seen))
        parts.append(f"{what} +{p50:.0f} / +{p99:.0f} ms")
    return f"p50 / p99 of each step, over {len(seen)} pods: created, " + ", ".join(parts)


def cpu_by_process(cluster: Cluster) -> dict[int, tuple[str, float]]:
    """pid -> (component, CPU seconds so far, user + system), for the harness's processes and
    the machine (pid 0: every CPU's busy time).

    Every component runs in a session of its own (the harness starts it with a new session), so
    a process's session id names its component; this process (the benchmark's clients) is
    `bench`, PostgreSQL server processes `postgresql`, anything else is left to `other`."""
    sessions = {
        int(info["pid"]): name for name, info in cluster.state.get("components", {}).items()
    }
    sessions[os.getsid(0)] = "bench"
    used: dict[int, tuple[str, float]] = {}
    for proc in psutil.process_iter(["name", "cpu_times"]):
        times = proc.info["cpu_times"]
        try:
            name = sessions.get(os.getsid(proc.pid))
        except OSError:
            continue  # gone meanwhile
        if name is None and proc.info["name"] == "postgres":
            name = "postgresql"  # the control plane's database server (and anyone else's)
        if name and times is not None:
            used[proc.pid] = (name, times.user + times.system)
    machine = psutil.cpu_times()  # every CPU: user, nice, system, irq, softirq
    busy = machine.user + machine.nice + machine.system + machine.irq + machine.softirq
    used[0] = ("machine", busy)
    return used


def cpu_spent(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds per component between two `cpu_by_process` readings, process by process
    (a database connection closed meanwhile takes its earlier CPU with it, so component totals
    cannot simply be subtracted); what the machine spent beyond them is `other`, which includes
    processes that exited before the second reading (database connections the pool closed
    after a minute idle in a long backlog)."""
    spent: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        earlier = before.get(pid)
        base = earlier[1] if earlier is not None and earlier[0] == name else 0.0
        spent[name] = spent.get(name, 0.0) + max(0.0, seconds - base)
    machine = spent.pop("machine", 0.0)
    spent["other"] = max(0.0, machine - sum(spent.values()))
    spent["machine"] = machine
    return spent


def apiserver_requests(api: Api) -> dict[str, float]:
    """kube-apiserver's request counts so far by verb and resource, from its /metrics."""
    response = api.session().get(f"{api.base}/metrics", timeout=30)
    response.raise_for_status()
    counts: dict[str, float] = {}
    for line in response.text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(
            part.split("=", 1) for part in line[line.index("{") + 1 : line.rindex("}")].split(",")
        )
        key = " ".join(
            labels.get(k, "").strip('"') for k in ("verb", "resource", "subresource")
        ).strip()
        counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def scheduler_metrics(cluster: Cluster, port: int) -> str | None:
    """kube-scheduler's /metrics at `port` (None, said on stderr, when it does not answer)."""
    try:
        with warnings.catch_warnings():  # the scheduler's self-signed serving certificate
            warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
            response = requests.get(
                f"https://127.0.0.1:{port}/metrics",
                cert=(str(cluster.pki / "admin.crt"), str(cluster.pki / "admin.key")),
                verify=False,  # noqa: S501
                timeout=30,
            )
        response.raise_for_status()
    except requests.RequestException as exc:
        print(f"  (no kube-scheduler metrics: {exc})", file=sys.stderr, flush=True)
        return None
    return response.text


def histogram_means(
    text: str, family: str, by: str, only: str = ""
) -> dict[str, tuple[int, float]]:
    """From a Prometheus text page, a histogram's observations summed over its series by the
    value of label `by` (series with `only` in their labels, when given): value -> (count,
    mean in ms), sorted by value, values never observed left out."""
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in text.splitlines():
        for prefix, into in ((f"{family}_count{{", counts), (f"{family}_sum{{", sums)):
            if line.startswith(prefix) and f'{by}="' in line and only in line:
                value = line.split(f'{by}="', 1)[1].split('"', 1)[0]
                into[value] = into.get(value, 0.0) + float(line.rsplit(" ", 1)[1])
    return {
        value: (int(n), 1000 * sums.get(value, 0.0) / n) for value, n in sorted(counts.items()) if n
    }


def scheduler_attempts(cluster: Cluster, port: int) -> str:
    """kube-scheduler's own account of its scheduling cycles, from its /metrics at `port`:
    attempts by result and their mean duration (the serial cycle: filter, extenders, score,
    reserve)."""
    text = scheduler_metrics(cluster, port)
    if text is None:
        return "(no kube-scheduler metrics)"
    means = histogram_means(text, "scheduler_scheduling_attempt_duration_seconds", "result")
    parts = [f"{result} {n} (mean {ms:.1f} ms)" for result, (n, ms) in means.items()]
    return "kube-scheduler attempts: " + (", ".join(parts) or "none")


def run_phase(
    namespace: str,
    label: str,
    cluster: Cluster,
    api: Api,
    extender: str | Hami,
    pods: int,
    paced: tuple[int, float],
    workers: int,
    timeout: float,
    webhook: bool,
    scheduler_name: str | None,
    profile: dict[str, Any] | None = None,
    burst: int = 0,
    dra: Dra | None = None,
) -> Result:
    """Throughput from a backlog, then latency from a paced stream, for one set-up.

    Throughput: `pods` pods are created while no scheduler runs, then the scheduler starts;
    pods/s = pods / (last binding - scheduler start). Creating pods from Python is slower than
    the scheduler, so pods created while it runs would measure the client, not the scheduler.
    Latency: `paced` = (count, rate) more pods created at that steady rate while the scheduler
    runs; p50/p99 of creation (the create call returning) to binding (seen on a watch).
    `scheduler_name`: the profile the pods name (None: Tessera's webhook names it).
    `extender`: "none", "tessera", the no-op extender's URL, or HAMi, whose own kube-scheduler
    then runs instead of the harness's.
    Burst: then `burst` pods created at once (a thread each) onto the nodes labelled
    BURST_LABEL, while the scheduler runs: seconds from the first create to the last binding.
    Last, the round's checks (`round_faults`), printed and counted in `faults`.
    `dra`: DRA mode (e): each pod points at the namespace's claim template instead of asking
    Tessera's resources, the claim controller starts with kube-scheduler, at the same moment
    (so the backlog's time includes making every pod's claim, as it would for pods arriving at
    a running cluster; it keeps running for the clean-up, which the caller does), and the cards
    are checked from the claims' allocations.
    """
    cluster.stop_component("kube-scheduler")
    api.post("/api/v1/namespaces", objects.namespace(namespace, webhook=webhook))
    api.post(
        f"/api/v1/namespaces/{namespace}/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}},
    )
    if dra is not None:
        path = f"{RESOURCE_API}/namespaces/{namespace}/resourceclaimtemplates"
        api.post(path, shared_claim_template(dra.template, dra.memory_mib, dra.compute))
    rv = api.get(f"/api/v1/namespaces/{namespace}/pods")["metadata"]["resourceVersion"]
    bound: dict[str, float] = {}
    nodes_seen: dict[str, set[str]] = {}
    created: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(
        target=watch_bindings, args=(api, namespace, rv, bound, nodes_seen, stop), daemon=True
    )
    watcher.start()
    made: dict[str, float] = {}
    protected: dict[str, float] = {}
    allocated: dict[str, float] = {}
    if dra is not None:
        claims_rv = api.get(f"{RESOURCE_API}/namespaces/{namespace}/resourceclaims")["metadata"][
            "resourceVersion"
        ]
        threading.Thread(
            target=watch_claims,
            args=(api, namespace, claims_rv, made, allocated, stop, protected),
            daemon=True,
        ).start()
    time.sleep(0.5)
    # Without an extender the four resources are ordinary extended resources to kube-scheduler,
    # and the nodes advertise only nvidia.com/gpu (slots): (a) asks for one slot, the others for
    # one slot of 1000 MiB and 5 % compute.
    sized = {} if extender == "none" else {"gpumem": 1000, "gpucores": 5}

    def create(name: str, selector: dict[str, str] | None = None) -> None:
        pod = objects.gpu_pod(name, scheduler_name=scheduler_name, **sized)
        if dra is not None:
            pod = with_claim_template(pod, dra.template)
        pod["spec"]["nodeSelector"].update(selector or {})
        api.post(f"/api/v1/namespaces/{namespace}/pods", pod)
        created[name] = time.monotonic()

    def wait_bound(names: list[str]) -> None:
        deadline = time.monotonic() + timeout
        while any(n not in bound for n in names) and time.monotonic() < deadline:
            time.sleep(0.2)

    backlog = [f"b-{i:05d}" for i in range(pods)]
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(create, backlog))
    load = os.getloadavg()
    cpu_before = cpu_by_process(cluster)
    requests_before = apiserver_requests(api)
    start = time.monotonic()
    if isinstance(extender, Hami):
        extender.start_scheduler()
        scheduler_port = extender.scheduler_port
    elif dra is not None:
        # Both at once, as both run in a cluster the pods arrive at: neither start waits on
        # the other's, and the claims are made while kube-scheduler starts.
        def start_controller() -> float:
            start_claim_controller(cluster, dra.controller, dra.qps)
            return time.monotonic() - start

        with ThreadPoolExecutor(1) as pool:
            controller = pool.submit(start_controller)
            cluster.start_scheduler(extender=extender, profile=profile)
            scheduler_ready = time.monotonic() - start
            controller_ready = controller.result()  # its failure stops the run, with its reason
        print(
            f"  (kube-scheduler answered its probe {scheduler_ready:.1f} s into the backlog, "
            f"the claim controller {controller_ready:.1f} s)",
            flush=True,
        )
        scheduler_port = cluster.state["components"]["kube-scheduler"]["ports"]["kube-scheduler"]
    else:
        cluster.start_scheduler(extender=extender, profile=profile)
        scheduler_port = cluster.state["components"]["kube-scheduler"]["ports"]["kube-scheduler"]
    wait_bound(backlog)
    done = [n for n in backlog if n in bound]
    last = max((bound[n] for n in done), default=start)
    cpu_after = cpu_by_process(cluster)
    backlog_wall = max(time.monotonic() - start, 1e-9)
    attempts = scheduler_attempts(cluster, scheduler_port)
    if dra is not None:
        attempts += f"\n  {dra_plugin_times(cluster, scheduler_port)}"
    requests_after = apiserver_requests(api)

    count, rate = paced
    stream = [f"s-{i:05d}" for i in range(count)]
    began = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        for i, name in enumerate(stream):
            time.sleep(max(0.0, began + i / rate - time.monotonic()))
            pool.submit(create, name)
    wait_bound(stream)
    bursts: list[float] = []
    if burst:
        names = [f"u-{i:05d}" for i in range(burst)]
        burst_began = time.monotonic()
        with ThreadPoolExecutor(burst) as pool:
            list(pool.map(lambda n: create(n, {BURST_LABEL: "true"}), names))
        wait_bound(names)
        if all(n in bound for n in names):
            bursts.append(max(bound[n] for n in names) - burst_began)
    items = api.get(f"/api/v1/namespaces/{namespace}/pods")["items"]
    cards_used, over, doubled, lost, pending = round_faults(items, set(created), nodes_seen)
    if dra is not None:  # the pods carry no card: kube-scheduler's record is the claims'
        cards_used, over = over_allocated_claims(claims_of(api, namespace), dra.devices)
    stop.set()
    latencies = sorted(
        max(0.0, bound[n] - created[n]) * 1000 for n in stream if n in bound and n in created
    )
    p50, p99 = _percentiles(latencies)
    # Where in the stream its slowest pods were created: a tail made by the backlog's aftermath
    # (kwok starting its pods, the reconciler catching up) sits in the stream's first seconds.
    slowest = sorted(
        (n for n in stream if n in bound and n in created),
        key=lambda n: bound[n] - created[n],
        reverse=True,
    )[: max(3, len(stream) // 100)]
    tail = ", ".join(
        f"{created[n] - began:.1f} s ({1000 * (bound[n] - created[n]):.0f} ms)" for n in slowest
    )
    result = Result(
        label=label,
        pods=pods + count,
        bound=len(done) + len(latencies),
        seconds=last - start,
        p50_ms=p50,
        p99_ms=p99,
        throughput=len(done) / (last - start) if last > start else 0.0,
        backlog_bound=len(done),
        latencies=latencies,
        bursts=bursts,
        faults=len(over) + len(doubled) + len(lost),
    )
    spent = cpu_spent(cpu_before, cpu_after)
    machine = spent.pop("machine")
    result.cpu_s = machine
    print(
        f"{label:36} {len(done):5d}/{pods} bound at {result.pods_per_s:7.1f} pods/s   "
        f"{len(latencies):4d}/{count} at {rate:g}/s: p50 {result.p50_ms:7.0f} ms, "
        f"p99 {result.p99_ms:7.0f} ms",
        flush=True,
    )
    scheduling = scheduler_side(spent, len(done))
    # Where the backlog's CPU went (the machine's cores are shared by every component).
    spent = {name: seconds for name, seconds in spent.items() if seconds >= 0.05}
    print(f"  {attempts}", flush=True)
    print(f"  CPU per backlog pod, scheduler side: {scheduling}", flush=True)
    print(
        f"  the stream's slowest pods, created at (of {count / rate:.1f} s): {tail or 'none'}",
        flush=True,
    )
    if dra is not None:
        print(
            f"  the stream's {claim_steps(stream, created, made, allocated, bound, protected)}",
            flush=True,
        )
    served = {
        key: requests_after[key] - requests_before.get(key, 0.0)
        for key in requests_after
        if requests_after[key] - requests_before.get(key, 0.0) >= max(1, pods // 100)
    }
    print(
        "  kube-apiserver requests over the backlog, per pod: "
        + ", ".join(
            f"{key} {n / pods:.2f}" for key, n in sorted(served.items(), key=lambda kv: -kv[1])
        ),
        flush=True,
    )
    print(
        f"  machine load before the backlog: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, "
        f"15 min); outside the harness during it: {spent.get('other', 0.0):.1f} CPU s",
        flush=True,
    )
    print(
        f"  CPU over the backlog ({backlog_wall:.1f} s wall, {os.cpu_count()} CPUs, "
        f"{machine:.1f} s used, {1000 * machine / max(len(done), 1):.1f} ms per pod): "
        + ", ".join(f"{n} {t:.1f} s" for n, t in sorted(spent.items(), key=lambda kv: -kv[1])),
        flush=True,
    )
    if burst:
        took = f"all bound in {bursts[0]:.2f} s" if bursts else f"NOT all bound in {timeout:g} s"
        print(f"  burst: {burst} pods created at once onto the burst nodes, {took}", flush=True)
    print(
        f"  checks: of the {cards_used} cards given to pods, over their memory, compute or slots "
        f"{len(over)}; pods bound twice "
        f"{len(doubled)}, pods lost {len(lost)}; still pending at the timeout {len(pending)}"
        + "".join(f"\n    {what}: {', '.join(names[:5])}" for what, names in (
            ("over", over), ("twice", doubled), ("lost", lost), ("pending", pending)) if names),
        flush=True,
    )  # fmt: skip
    return result


# The processes on a pod's way from creation to binding, whichever set-up runs them: the
# schedulers, the extenders, the claim controller, Tessera's control plane and reconciler.
SCHEDULER_SIDE = (
    "kube-scheduler",
    "hami-kube-scheduler",
    "noop-extender",
    "extender",
    "hami-scheduler",
    CLAIM_CONTROLLER,
    "controlplane",
    "webhook",
    "celery",
    "celery-worker",
    "celery-beat",
)


def scheduler_side(spent: dict[str, float], pods: int) -> str:
    """CPU ms per pod of each scheduler-side process that ran (`spent`: CPU seconds by
    component over the backlog, `pods` bound in it)."""
    parts = [
        f"{name} {1000 * spent[name] / max(pods, 1):.1f} ms"
        for name in SCHEDULER_SIDE
        if name in spent
    ]
    return ", ".join(parts) or "none measured"


def settle(cluster: Cluster, timeout: float = 180) -> None:
    """Wait until the harness's processes are idle again (kwok has finished the deleted pods,
    the reconciler has released their slices), so the next set-up's backlog pays for none of
    the last one's clean-up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = cpu_by_process(cluster)
        time.sleep(2)
        spent = cpu_spent(before, cpu_by_process(cluster))
        busy = sum(t for name, t in spent.items() if name not in ("machine", "other"))
        if busy < 0.3:  # under 0.15 cores
            return
    print(f"  (the cluster was still busy {timeout:.0f} s after the clean-up)", flush=True)


def clean_up(api: Api, namespace: str, timeout: float, workers: int) -> None:
    """Delete a phase's pods (kwok finishes them) so the next phase starts on empty nodes.

    One DELETE per pod from a thread pool: a single delete-collection of thousands of pods runs
    past the API server's request timeout and stops part-way.
    """

    def delete(name: str) -> None:
        resp = api.session().delete(
            f"{api.base}/api/v1/namespaces/{namespace}/pods/{name}?gracePeriodSeconds=0",
            timeout=60,
        )
        if resp.status_code not in (200, 202, 404):
            resp.raise_for_status()

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        items = api.get(f"/api/v1/namespaces/{namespace}/pods")["items"]
        if not items:
            return
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(delete, [p["metadata"]["name"] for p in items]))
        time.sleep(1)
    raise RuntimeError(f"the pods of {namespace} were not gone within {timeout:.0f} s")


def print_extender_times(cluster: Cluster) -> None:
    """Mean time Tessera took per verb in (c), from its own /metrics (where the pod's time went:
    filter and prioritize are on kube-scheduler's serial scheduling cycle, bind is not)."""
    response = requests.get(
        f"{cluster.extender_url}/metrics",
        headers={"Authorization": f"Bearer {cluster.admin_token}"},
        timeout=30,
    )
    if response.status_code != 200:
        print(f"  (no extender metrics: /metrics answered {response.status_code})")
        return
    sums: dict[tuple[str, str], float] = {}
    for line in response.text.splitlines():
        for part in ("sum", "count"):
            prefix = f'tessera_extender_request_seconds_{part}{{verb="'
            if line.startswith(prefix):
                verb = line[len(prefix) :].split('"', 1)[0]
                sums[(verb, part)] = float(line.rsplit(" ", 1)[1])
    outcomes = [
        line.replace("tessera_bind_outcomes_total", "").replace(".0", "")
        for line in response.text.splitlines()
        if line.startswith("tessera_bind_outcomes_total{")
    ]
    for line in response.text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"tessera_extender_bind_apiserver_seconds_{part} "):
                sums[("bind: API server part", part)] = float(line.rsplit(" ", 1)[1])
    means = [
        f"{verb} {1000 * sums[(verb, 'sum')] / sums[(verb, 'count')]:.1f} ms"
        for verb in ("filter", "prioritize", "bind", "bind: API server part")
        if sums.get((verb, "count"))
    ]
    print(f"  Tessera's mean answer time per verb in (c): {', '.join(means)}", flush=True)
    print(f"  bind outcomes: {', '.join(outcomes)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--cards", type=int, default=8)
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=8, help="threads creating pods")
    parser.add_argument("--paced", type=int, default=500, help="pods of the latency stream")
    parser.add_argument("--rate", type=float, default=20, help="pods/s of the latency stream")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per phase")
    parser.add_argument(
        "--burst",
        type=int,
        default=64,
        help="pods created at once onto --burst-nodes nodes, per round of (c) and (d) (0: none)",
    )
    parser.add_argument("--burst-nodes", type=int, default=16)
    parser.add_argument(
        "--only",
        default=None,
        help="set-ups to run, e.g. a,c,e (default a,b,c,d,e, less d when HAMi cannot be had here)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="split each set-up's pods into this many backlogs, run in the order a b c d e, "
        "then e d c b a, ...: the machine's speed drifts over a run, and the mirrored order "
        "gives every set-up the same share of early and late",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also run (v): Tessera's extender with this setting (repeatable), scheduled with "
        "(c) in the mirrored order, to compare two settings side by side in one run",
    )
    parser.add_argument(
        "--variant-checkout",
        type=Path,
        default=None,
        metavar="DIR",
        help="also run (v): the extender sidecar from the code of another clone of the project "
        "(e.g. the commit before a change), on the same cluster, database and settings (a clone "
        "without controlplane/sidecar.py runs granian's own command line)",
    )
    parser.add_argument(
        "--variant-profile",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also run (v): Tessera with this field of its kube-scheduler profile (repeatable; "
        "an integer value is sent as one), e.g. percentageOfNodesToScore=0",
    )
    parser.add_argument(
        "--claim-qps",
        type=int,
        default=1000,
        help="(e): requests/s of the claim controller's client, burst twice that (default: "
        "what the harness gives kube-scheduler's; 0: kube-controller-manager's own default, "
        "20/s burst 30, about 10 pods/s)",
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", ""),
        help="a PostgreSQL server for the control plane (a scratch database is made on it and "
        "dropped); default: SQLite in the run folder",
    )
    args = parser.parse_args(argv)
    variant = settings_from(parser, "--variant", args.variant)
    checkout = args.variant_checkout.resolve() if args.variant_checkout else None
    if checkout is not None and not (checkout / "controlplane" / "wsgi.py").is_file():
        parser.error(f"--variant-checkout {checkout}: no controlplane/wsgi.py there")
    profile: dict[str, Any] = {
        k: int(v) if v.lstrip("-").isdigit() else v
        for k, v in settings_from(parser, "--variant-profile", args.variant_profile).items()
    }
    phases = set((args.only or "a,b,c,d,e").split(","))
    if not phases <= set("abcde"):
        parser.error(f"--only {args.only}: set-ups are a, b, c, d and e")
    hami_found: dict[str, Path] = {}
    if "d" in phases:  # before the cluster: a cold build takes minutes
        try:
            hami_found = hami_binaries()
        except HarnessError as exc:
            if args.only is not None:
                raise
            phases.discard("d")
            print(f"# (d) left out: HAMi's scheduler cannot be built here ({exc})", flush=True)
    phases |= {"v"} if variant or checkout or profile else set()
    controller: Path | None = None
    if "e" in phases:  # before the cluster, and never skipped: (e) is what DRA mode is for
        controller = build_binaries(("kube-controller-manager",))["kube-controller-manager"]

    scratch = ScratchDatabase(args.database_url or None, Path(tempfile.mkdtemp()))
    env = {"TESSERA_LOG_LEVEL": "WARNING"}
    if args.database_url:
        os.environ["TESSERA_E2E_DATABASE_URL"] = scratch.url  # the harness's own database
    options = Options(
        run_dir=run_folder("run-bench"),
        extender="none",
        access_log=False,
        controlplane_env=env,
    )
    print(
        f"# bench_e2e: {args.nodes} kwok nodes x {args.cards} cards, {args.pods} one-slice "
        f"pods per set-up, {args.workers} creating threads, control plane on "
        f"{'PostgreSQL' if args.database_url else 'SQLite'}",
        flush=True,
    )
    cluster = Cluster(options)
    try:
        cluster.up()
    except HarnessError as exc:
        print(f"bench_e2e: the cluster did not come up: {exc}", file=sys.stderr)
        scratch.drop()
        return 1
    rounds = max(1, args.rounds)
    by_key: dict[str, list[Result]] = {}
    labels: dict[str, str] = {}
    hami: Hami | None = None
    dra: Dra | None = None
    try:
        api = Api(cluster)
        inventories = setup_nodes(cluster, api, args.nodes, args.cards, args.workers)
        label_burst_nodes(api, sorted(inventories)[: args.burst_nodes])
        if controller is not None:
            dra = prepare_dra(
                cluster,
                api,
                sorted(inventories),
                args.cards,
                args.workers,
                controller,
                args.claim_qps or None,
            )
        if hami_found:
            hami = Hami(cluster, hami_found)
            hami.register_nodes(api, inventories)
            print(f"# (d): {hami.chart.source}", flush=True)
        # (d) twice: HAMi's API client as shipped, and allowed what Tessera's client may do.
        clients = {"d": SHIPPED, "dr": RAISED}
        plan: list[tuple[str, str, str | None, bool]] = [
            ("a", "(a) kube-scheduler, no extender", "none", False),
            ("b", "(b) + no-op extender", None, False),
            ("c", "(c) + Tessera extender", "tessera", True),
            ("d", "(d) HAMi, client as shipped 5/s b10", "hami", False),
            ("dr", f"(d) HAMi, client raised {RAISED[0]}/s b{RAISED[1]}", "hami", False),
            ("e", "(e) DRA mode, no extender", "none", True),
        ]
        if variant or checkout or profile:
            what = (
                [f"{k}={v}" for k, v in variant.items()]
                + [f"code of {checkout}"] * bool(checkout)
                + [f"profile {k}={v}" for k, v in profile.items()]
            )
            plan.append(("v", f"(v) Tessera, {' '.join(what)}", "tessera", True))
        sidecar: tuple[dict[str, str], Path] = ({}, ROOT)
        schedule = [
            (r, *phase)
            for r in range(rounds)
            for phase in (plan if r % 2 == 0 else plan[::-1])
            if phase[0][0] in phases
        ]
        noop = ""
        mode = ""  # the control plane's TESSERA_MODE: its default, extender, until (e)
        for i, (r, key, label, named, webhook) in enumerate(schedule):
            if (key == "e") != (mode == "dra"):
                # (e) meets the control plane as a DRA-mode deployment runs it (its webhook,
                # its reconciler mirroring claims); the others, as extender mode does.
                mode = "dra" if key == "e" else ""
                began = time.monotonic()
                cluster.restart_controlplane({**env, "TESSERA_MODE": mode} if mode else env)
                print(
                    f"# the control plane and its reconciler restarted with TESSERA_MODE="
                    f"{mode or 'unset (extender)'} in {time.monotonic() - began:.0f} s",
                    flush=True,
                )
                settle(cluster)
            extender: str | Hami = named or ""
            scheduler_name: str | None = None if webhook else "tessera-scheduler"
            if named is None:
                noop = noop or cluster.start_noop_extender()
                extender = noop
            if named == "hami" and hami is not None:
                # Only for its own rounds: its informers and its 15 s registration pass would
                # cost the other set-ups CPU.
                hami.start(args.nodes * args.cards, clients[key])
                extender, scheduler_name = hami, hami.scheduler_name
            if named == "tessera":
                wanted = (variant, checkout or ROOT) if key == "v" else ({}, ROOT)
                if wanted != sidecar:
                    cluster.restart_extender(*wanted)
                    sidecar = wanted
            labels[key] = label
            namespace = f"bench-{key}" if rounds == 1 else f"bench-{key}-{r + 1}"
            result = run_phase(
                namespace,
                label if rounds == 1 else f"{label} {r + 1}/{rounds}",
                cluster,
                api,
                extender,
                args.pods // rounds,
                (args.paced // rounds, args.rate),
                args.workers,
                args.timeout,
                webhook,
                scheduler_name,
                profile if key == "v" else None,
                args.burst if key in ("c", "d", "dr") else 0,
                dra if key == "e" else None,
            )
            by_key.setdefault(key, []).append(result)
            if key in "cv" and not any(k == key for _, k, *_ in schedule[i + 1 :]):
                print_extender_times(cluster)
            if isinstance(extender, Hami):
                print(f"  {extender.plugin_summary()}", flush=True)
                extender.stop()
            if i < len(schedule) - 1:
                clean_up(api, namespace, args.timeout, args.workers)
                if key == "e":
                    clean_up_claims(api, namespace, args.timeout, args.workers)
            if key == "e":
                # Only for its own rounds, as HAMi's: its informers would cost the others CPU.
                cluster.stop_component(CLAIM_CONTROLLER)
            if i < len(schedule) - 1:
                settle(cluster)
    finally:
        if hami is not None:
            hami.stop()
        cluster.down()
        scratch.drop()
    results = {key: combine(labels[key], runs) for key, runs in by_key.items()}
    if rounds > 1:
        print(f"# each set-up over its {rounds} rounds:")
        for result in results.values():
            print(
                f"{result.label:36} {result.bound:5d}/{result.pods} bound, backlogs at "
                f"{result.pods_per_s:7.1f} pods/s, {result.cpu_ms_per_pod:.1f} CPU ms per pod; "
                f"at {args.rate:g}/s: p50 {result.p50_ms:7.0f} ms, p99 {result.p99_ms:7.0f} ms"
                + (f"; burst {result.burst_s:.2f} s" if result.bursts else "")
                + f"; faults {result.faults}",
                flush=True,
            )
    a, b, c = (results.get(k) for k in "abc")
    if c and b and b.pods_per_s:
        verdict = "meets" if c.pods_per_s >= 0.9 * b.pods_per_s else "MISSES"
        print(f"(c)/(b) throughput: {c.pods_per_s / b.pods_per_s:.2f} ({verdict} the 0.9 target)")
    if c and a and a.pods_per_s:
        print(f"(c)/(a) throughput: {c.pods_per_s / a.pods_per_s:.2f}")
    if c and b and b.p99_ms:
        verdict = "meets" if c.p99_ms <= 1.2 * b.p99_ms else "MISSES"
        print(f"(c)/(b) p99 latency: {c.p99_ms / b.p99_ms:.2f} ({verdict} the 1.2 target)")
    for key in ("d", "dr"):
        d = results.get(key)
        if c and d:
            print(f"(c)/(d) Tessera against {d.label[4:]}: " + ratios(c, d), flush=True)
    e = results.get("e")
    if e:
        for line in goals(e, a, c):
            print(line, flush=True)
    v = results.get("v")
    if v and b and b.pods_per_s:
        print(f"(v)/(b) throughput: {v.pods_per_s / b.pods_per_s:.2f}")
    if v and c and c.pods_per_s:
        print(f"(v)/(c) throughput: {v.pods_per_s / c.pods_per_s:.2f}")
    return 0 if all(r.bound == r.pods and not r.faults for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
