"""Builders and readers shared by the node plugin's integration tests."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid as uuidlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.nodeplugin.harness.controlplane import FakeControlPlane, record
from tests.nodeplugin.harness.kubelet import Container, Pod
from tests.nodeplugin.harness.plugin import NODE
from tests.shim.test_shared_region import blank_region

Slice = tuple[str, int, int]  # card uuid, memory MiB, cores %
Scrape = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> (labels, value)


def bind_pod(
    plane: FakeControlPlane,
    name: str,
    containers: list[tuple[str, bool, list[Slice]]],
    *,
    namespace: str = "team-a",
    node: str = NODE,
    key: bytes | None = None,
    priorities: dict[str, int] | None = None,
    modes: dict[str, dict[str, Any]] | None = None,
) -> tuple[Pod, str]:
    """What the extender's bind leaves: a ledger record (+ annotations); returns the kubelet's
    view of the pod and the record's JSON. ``priorities``: by container name."""
    uid = str(uuidlib.uuid4())
    index = {True: 0, False: 0}
    rows = []
    for cname, init, slices in containers:
        rows.append((cname, index[init], init, slices))
        index[init] += 1
    raw = record(uid, namespace, name, node, rows, priorities, modes)
    plane.bind(raw, key=key)
    pod = Pod(namespace, name, [Container(c, len(s), init) for c, init, s in containers])
    return pod, raw


def cdi_name(pod: Pod, container: str) -> str:
    resp = pod.responses[container]
    assert len(resp.cdi_devices) >= 1, resp
    return resp.cdi_devices[0].name


def cdi_spec(cdi_dir: Path, qualified: str) -> dict[str, Any]:
    kind, _, name = qualified.partition("=")
    path = cdi_dir / f"{kind.replace('/', '_')}-{name}.json"
    data: dict[str, Any] = json.loads(path.read_text())
    assert data["kind"] == kind
    assert [d["name"] for d in data["devices"]] == [name]
    return data


def spec_env(spec: dict[str, Any]) -> dict[str, str]:
    env = spec["devices"][0]["containerEdits"]["env"]
    return dict(e.split("=", 1) for e in env)


def spec_nodes(spec: dict[str, Any]) -> list[str]:
    return [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]


def expected_env(slices: list[Slice]) -> dict[str, str]:
    env = {}
    for i, (_, mem, cores) in enumerate(slices):
        env[f"TESSERA_DEVICE_MEMORY_LIMIT_{i}"] = str(mem)
        env[f"TESSERA_DEVICE_CORE_LIMIT_{i}"] = str(cores)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(u for u, _, _ in slices)
    env["NVIDIA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def scrape(port: int) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


async def scrape_when(port: int, ready: Callable[[Scrape], bool], timeout: float = 15.0) -> Scrape:
    """The first scrape ``ready`` accepts: the plugin samples in a thread, so what a test just
    wrote shows after the next sample, not at once. The timeout is generous (a loaded machine
    runs three test workers beside a cluster): waiting ends as soon as ``ready`` holds."""
    deadline = time.monotonic() + timeout
    while True:
        m = await asyncio.to_thread(scrape, port)
        if ready(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"the metrics never became what the test waits for: {m}")
        await asyncio.sleep(0.05)


def region_bytes(
    limit_mib: int,
    used: int,
    *,
    core_pct: int = 0,
    pid: int = 7,
    start_time: int = 0,
    launches: int = 0,
    spilled: int = 0,
) -> bytes:
    """A region as the shim writes it: device 0 limited to ``limit_mib`` and ``core_pct``, one
    process (``pid`` inside the container) holding ``used`` bytes on it, ``spilled`` of them
    past the resident part."""
    r = blank_region()
    r.hdr.proc_hwm = 1
    r.dev[0].mem_limit_bytes = limit_mib << 20
    r.dev[0].core_limit_pct = core_pct
    r.dev[0].launches = launches
    r.proc[0].pid = pid
    r.proc[0].start_time = start_time
    r.proc[0].used[0] = used
    r.proc[0].spilled[0] = spilled
    return bytes(r)
