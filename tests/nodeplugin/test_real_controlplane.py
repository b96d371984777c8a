"""The plugin against the real control plane: Django's live server with the real inventory,
allocation and allocated endpoints, the real extender bind (the Kubernetes adapter faked at its
getter, as in tests/extender), and the plugin process speaking to it over HTTP."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from django.db import OperationalError
from django.test import Client

from controlplane.access.roles import Role
from controlplane.access.services import create_token
from controlplane.ledger.models import Card, PodBinding
from tests.extender.builders import bind_args
from tests.extender.conftest import FakeKube, fake_kube  # noqa: F401 - fixture
from tests.nodeplugin.conftest import eventually, fake_node, run
from tests.nodeplugin.harness.gpu import cards as gpu_cards
from tests.nodeplugin.harness.kubelet import Container, Pod
from tests.nodeplugin.harness.plugin import NODE
from tests.nodeplugin.helpers import cdi_name, cdi_spec, spec_env, spec_nodes
from tests.pods import gpu_pod


def _bind(pod: dict[str, Any]) -> dict[str, Any]:
    response = Client().post(
        "/scheduler/bind", data=json.dumps(bind_args(pod, NODE)), content_type="application/json"
    )
    body: dict[str, Any] = response.json()
    return body


@pytest.mark.django_db(transaction=True)
def test_plugin_with_the_real_control_plane(
    live_server: Any,
    fake_kube: FakeKube,  # noqa: F811
    short_tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The ORM is used from the test's own thread, which runs the event loop: allow sync calls.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    token_file = short_tmp / "node-token"
    token_file.write_text(create_token(NODE, Role.NODE) + "\n")

    def cards() -> int:
        try:
            return Card.objects.filter(node__name=NODE).count()
        except OperationalError:  # SQLite: the report's transaction is still open
            return -1

    async def main() -> None:
        async with fake_node(
            short_tmp,
            TESSERA_CONTROLPLANE_URL=live_server.url,
            TESSERA_TOKEN_FILE=str(token_file),
            TESSERA_HEARTBEAT_S="3600",  # one report: no request in flight during ORM reads
        ) as node:
            await eventually(lambda: cards() == 4, timeout=10, what="the inventory to land")
            # the real extender binds the pod onto the cards the plugin reported
            pod_json = fake_kube.add(gpu_pod("trainer", "team-a", gpus=2, mem=3000, cores=25))
            result = _bind(pod_json)
            assert result == {"Error": ""}, result
            pod = Pod("team-a", "trainer", [Container("main", 2)])
            await node.kubelet.admit(pod)
            await node.kubelet.start_container(pod, "main")
            binding = PodBinding.objects.get(pod_uid=pod_json["metadata"]["uid"])
            assert binding.phase == PodBinding.Phase.ALLOCATED
            record = json.loads(
                fake_kube.pods[("team-a", "trainer")]["metadata"]["annotations"][
                    "tessera.io/allocation"
                ]
            )
            uuids = [d["uuid"] for d in record["containers"][0]["devices"]]
            spec = cdi_spec(node.plugin.cdi_dir, cdi_name(pod, "main"))
            env = spec_env(spec)
            assert env["CUDA_VISIBLE_DEVICES"] == ",".join(uuids)
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_0"] == "3000"
            assert env["TESSERA_DEVICE_MEMORY_LIMIT_1"] == "3000"
            assert env["TESSERA_DEVICE_CORE_LIMIT_0"] == "25"
            minor = {c.uuid: c.minor for c in node.gpu.cards}
            assert spec_nodes(spec)[:2] == [f"/dev/nvidia{minor[u]}" for u in uuids]
            assert {i.split("::")[0] for i in pod.devices["main"]} == set(uuids)
            assert "Unauthorized" not in node.plugin.text()

    run(main)


@pytest.mark.django_db(transaction=True)
def test_mig_capable_cards_report_to_the_real_control_plane(
    live_server: Any, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cards' MIG state rides the inventory where the control plane takes it; one that
    predates card modes refuses the key, and the node must keep reporting all the same."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    token_file = short_tmp / "node-token"
    token_file.write_text(create_token(NODE, Role.NODE) + "\n")
    card_list = [dataclasses.replace(c, mig=True) for c in gpu_cards(2)]

    def landed() -> bool:
        try:
            return Card.objects.filter(node__name=NODE).count() == 2
        except OperationalError:  # SQLite: the report's transaction is still open
            return False

    async def main() -> None:
        async with fake_node(
            short_tmp,
            card_list,
            TESSERA_CONTROLPLANE_URL=live_server.url,
            TESSERA_TOKEN_FILE=str(token_file),
            TESSERA_HEARTBEAT_S="3600",
            TESSERA_PROC_ROOT=str(short_tmp / "proc"),
        ) as node:
            await eventually(landed, timeout=10, what="the inventory to land")
            taken = all(c.mig_capable for c in Card.objects.filter(node__name=NODE))
            fell_back = "does not take the cards' MIG state" in node.plugin.text()
            assert taken or fell_back, node.plugin.text()

    run(main)
