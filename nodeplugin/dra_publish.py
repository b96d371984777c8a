"""Publishing the node's ResourceSlices through the API server, level-based (docs/dra.md).

Each pass lists the slices of Tessera's driver on this node, builds the pool from the node's
state (:func:`~nodeplugin.dra_slices.build_slices`), and applies the difference: a missing slice
is created, one whose spec differs is replaced, one the pool no longer has (the counters slice
once no card is in MIG mode) is deleted. The pool's generation goes up exactly when what it
publishes changes, continuing after a restart from the highest generation the API server holds.
A pass runs on every change the plugin signals (health, card modes, the kubelet registering the
driver again) and every ``resync_s``: the kubelet deletes a driver's slices when its plugin is
gone a while, and an operator may delete one by hand; the next pass puts them back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

from nodeplugin.dra_slices import DRIVER, Pool, SliceError
from nodeplugin.http import HttpUnavailable
from nodeplugin.kubeapi import KubeApiError

log = logging.getLogger("nodeplugin.dra")
Slice = dict[str, Any]


class SliceApi(Protocol):
    async def list_resource_slices(self, node: str, driver: str) -> list[Slice]: ...

    async def create_resource_slice(self, body: Slice) -> Slice: ...

    async def replace_resource_slice(self, body: Slice) -> Slice: ...

    async def delete_resource_slice(self, name: str, uid: str) -> None: ...


def _generation(item: Slice) -> int:
    try:
        return int(item["spec"]["pool"]["generation"])
    except (KeyError, TypeError, ValueError):
        return 0


class SlicePublisher:
    """The one writer of this node's ResourceSlices."""

    def __init__(
        self,
        api: SliceApi,
        node: str,
        build: Callable[[int], list[dict[str, object]]],
        resync_s: float,
    ) -> None:
        self.api = api
        self.node = node
        self.build = build
        self.resync_s = resync_s
        self.pool: Pool | None = None
        self.desired: list[Slice] = []
        self.writes = 0  # creates, replaces and deletes sent (a pass with nothing to do: none)
        # name -> (the spec written, the spec the API server stored for it): the server adds
        # defaults (a taint's timeAdded), so what it holds is compared with what it answered.
        self._stored: dict[str, tuple[Any, Any]] = {}
        self._kick = asyncio.Event()

    def kick(self) -> None:
        """Publish now: the node's state changed."""
        self._kick.set()

    async def sync(self) -> None:
        """One pass; raises on an API or build error (nothing is left half-known: the next
        pass lists again)."""
        existing = {
            str(s["metadata"]["name"]): s
            for s in await self.api.list_resource_slices(self.node, DRIVER)
        }
        if self.pool is None:
            self.pool = Pool(max((_generation(s) for s in existing.values()), default=0))
        fresh = self.pool.update(self.build)
        if fresh is not None:
            self.desired = [dict(s) for s in fresh]
            log.info(
                "ResourceSlices of %s at generation %d: %d device(s)",
                self.node,
                self.pool.generation,
                sum(len(s["spec"].get("devices") or []) for s in self.desired),
            )
        for want in self.desired:
            name = str(want["metadata"]["name"])
            have = existing.pop(name, None)
            if have is None:
                answer = await self.api.create_resource_slice(want)
            elif not self._up_to_date(name, want, have):
                meta = {**want["metadata"], "resourceVersion": have["metadata"]["resourceVersion"]}
                answer = await self.api.replace_resource_slice({**want, "metadata": meta})
            else:
                continue
            self._stored[name] = (want["spec"], answer.get("spec"))
            self.writes += 1
        for name, extra in existing.items():
            await self.api.delete_resource_slice(name, str(extra["metadata"]["uid"]))
            self.writes += 1

    def _up_to_date(self, name: str, want: Slice, have: Slice) -> bool:
        if have.get("spec") == want["spec"]:
            return True
        written = self._stored.get(name)
        return written is not None and written == (want["spec"], have.get("spec"))

    async def run(self, stopping: asyncio.Event) -> None:
        failures = 0
        while not stopping.is_set():
            self._kick.clear()
            delay = self.resync_s
            try:
                await self.sync()
                if failures:
                    log.warning("ResourceSlices published again after %d failure(s)", failures)
                failures = 0
            except (KubeApiError, HttpUnavailable) as exc:
                failures += 1
                delay = min(self.resync_s, 0.5 * 2 ** min(failures, 6))
                log.error("publishing ResourceSlices failed (%s); next try in %.1fs", exc, delay)
            except SliceError as exc:
                # The node's state cannot be published (an API limit): it stays so until the
                # state changes, which kicks the next pass.
                log.error("the node's ResourceSlices cannot be built: %s", exc)
            stop = asyncio.ensure_future(stopping.wait())
            kick = asyncio.ensure_future(self._kick.wait())
            await asyncio.wait({stop, kick}, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            for f in (stop, kick):
                f.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await f
