"""The ResourceSlice publisher's passes against an API server kept in memory (docs/dra.md,
*Serving, registration, publishing*); the real kube-apiserver's side is
tests/deploy/test_install_dra.py."""

from __future__ import annotations

import asyncio
import copy
import itertools
from typing import Any

import pytest

from nodeplugin.cards import Card
from nodeplugin.dra_publish import SlicePublisher
from nodeplugin.dra_slices import DRIVER, MigLayout, MigOffer, build_slices, slice_name
from nodeplugin.kubeapi import KubeApiConflict, KubeApiError

NODE = "node-1"
CARDS = [Card("GPU-a", 0, "A100", 81920, 0, 0), Card("GPU-b", 1, "A100", 81920, 1, 0)]
MIG = {"GPU-b": MigLayout(8, (MigOffer("3g.40gb", 0, 4, 40192), MigOffer("3g.40gb", 4, 4, 40192)))}


class MemoryApi:
    """Stores what it is given, as the API server would: a UID and a resourceVersion each."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail_next: Exception | None = None
        self._version = itertools.count(1)

    def _check(self) -> None:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc

    def put(self, body: dict[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(next(self._version))
        stored["metadata"].setdefault("uid", f"uid-{stored['metadata']['name']}")
        self.slices[stored["metadata"]["name"]] = stored
        return copy.deepcopy(stored)

    async def list_resource_slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        self._check()
        return [
            copy.deepcopy(s)
            for s in self.slices.values()
            if s["spec"].get("nodeName") == node and s["spec"]["driver"] == driver
        ]

    async def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check()
        self.calls.append(("create", body["metadata"]["name"]))
        if body["metadata"]["name"] in self.slices:
            raise KubeApiConflict("already exists")
        return self.put(body)

    async def replace_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check()
        name = body["metadata"]["name"]
        self.calls.append(("replace", name))
        if self.slices[name]["metadata"]["resourceVersion"] != body["metadata"]["resourceVersion"]:
            raise KubeApiConflict("modified")
        body = copy.deepcopy(body)
        body["metadata"]["uid"] = self.slices[name]["metadata"]["uid"]
        return self.put(body)

    async def delete_resource_slice(self, name: str, uid: str) -> None:
        self._check()
        self.calls.append(("delete", name))
        if self.slices[name]["metadata"]["uid"] != uid:
            raise KubeApiConflict("precondition failed")
        del self.slices[name]


def publisher(api: MemoryApi, modes: dict[str, str]) -> SlicePublisher:
    def slices_at(generation: int) -> list[dict[str, object]]:
        return build_slices(
            NODE, CARDS, modes=modes, health={}, slots=4, generation=generation, mig=MIG
        )

    return SlicePublisher(api, NODE, slices_at, resync_s=1)


def generation(api: MemoryApi) -> set[int]:
    return {s["spec"]["pool"]["generation"] for s in api.slices.values()}


def test_the_counters_slice_comes_and_goes_with_a_mig_card() -> None:
    api = MemoryApi()
    modes: dict[str, str] = {}
    pub = publisher(api, modes)
    asyncio.run(pub.sync())
    assert set(api.slices) == {slice_name(NODE)} and generation(api) == {1}
    modes["GPU-b"] = "mig"
    asyncio.run(pub.sync())
    assert set(api.slices) == {slice_name(NODE), slice_name(NODE, counters=True)}
    assert generation(api) == {2}
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in api.slices.values()} == {2}
    modes.pop("GPU-b")
    asyncio.run(pub.sync())
    assert set(api.slices) == {slice_name(NODE)} and generation(api) == {3}
    assert ("delete", slice_name(NODE, counters=True)) in api.calls


def test_another_nodes_or_drivers_slices_are_never_touched() -> None:
    api = MemoryApi()
    theirs = build_slices("node-2", CARDS, modes={}, health={}, slots=4, generation=7)[0]
    api.put(dict(theirs))
    other_driver = copy.deepcopy(
        build_slices(NODE, CARDS, modes={}, health={}, slots=4, generation=1)[0]
    )
    other_driver["metadata"]["name"] = "node-1-other"
    other_driver["spec"]["driver"] = "gpu.example.com"
    api.put(other_driver)
    asyncio.run(publisher(api, {}).sync())
    assert api.slices["node-2-gpu.tessera.io"]["spec"]["pool"]["generation"] == 7
    assert "node-1-other" in api.slices
    assert api.calls == [("create", slice_name(NODE))]


def test_a_restart_continues_the_generation_and_a_failed_pass_is_redone() -> None:
    api = MemoryApi()
    asyncio.run(publisher(api, {}).sync())
    asyncio.run(publisher(api, {}).sync())  # a restarted plugin: next generation, same content
    assert generation(api) == {2}
    pub = publisher(api, {"GPU-a": "exclusive"})
    api.fail_next = KubeApiError("list resourceslices: API server answered 403")
    with pytest.raises(KubeApiError):
        asyncio.run(pub.sync())
    assert generation(api) == {2}  # nothing written
    asyncio.run(pub.sync())
    assert generation(api) == {3}
    device = api.slices[slice_name(NODE)]["spec"]["devices"][0]
    assert device["attributes"]["mode"] == {"string": "exclusive"}


def test_an_unchanged_node_writes_nothing_and_a_changed_slice_is_put_back() -> None:
    api = MemoryApi()
    pub = publisher(api, {})
    asyncio.run(pub.sync())
    asyncio.run(pub.sync())
    assert pub.writes == 1
    # Someone edits the slice: the next pass puts the pool's content back.
    api.slices[slice_name(NODE)]["spec"]["devices"] = []
    asyncio.run(pub.sync())
    assert pub.writes == 2
    assert len(api.slices[slice_name(NODE)]["spec"]["devices"]) == 2
    assert generation(api) == {1}


def test_run_retries_after_an_unreachable_api_server_until_stopped() -> None:
    api = MemoryApi()
    pub = publisher(api, {})
    api.fail_next = KubeApiError("list resourceslices: API server answered 503")

    async def scenario() -> None:
        stopping = asyncio.Event()
        task = asyncio.create_task(pub.run(stopping))
        for _ in range(200):
            if api.slices:
                break
            await asyncio.sleep(0.01)
        stopping.set()
        await asyncio.wait_for(task, 2)

    asyncio.run(scenario())
    assert set(api.slices) == {slice_name(NODE)}
    assert api.slices[slice_name(NODE)]["spec"]["driver"] == DRIVER
