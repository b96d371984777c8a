"""Builders and readers shared by the node plugin's integration tests."""

from __future__ import annotations

import json
import uuid as uuidlib
from pathlib import Path
from typing import Any

from tests.nodeplugin.harness.controlplane import FakeControlPlane, record
from tests.nodeplugin.harness.kubelet import Container, Pod
from tests.nodeplugin.harness.plugin import NODE

Slice = tuple[str, int, int]  # card uuid, memory MiB, cores %


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
