"""Task priority in the node plugin: who holds on which card (pure), and the monitor that reads
launch counts from the regions and writes the holds into them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nodeplugin import edits
from nodeplugin import shared_region as sr
from nodeplugin.allocation import ContainerAllocation, SliceDevice
from nodeplugin.cards import Card
from nodeplugin.owners import Owner
from nodeplugin.priority import LEASE_POLLS, Activity, PriorityMonitor, holds
from nodeplugin.writer import Writer
from tests.shim.test_shared_region import blank_region, blank_region_v2

MS = 1_000_000


def owner(name: str, priority: int | None, *uuids: str) -> Owner:
    return Owner(name, "ns", f"pod-{name}", "app", uuids, priority)


# --- who holds (pure) -----------------------------------------------------------------------


def test_low_priority_holds_while_high_priority_is_busy_on_its_card() -> None:
    hi, lo = owner("hi", 0, "GPU-a"), owner("lo", 1, "GPU-a")
    assert holds([hi, lo], {"hi": frozenset({0})}) == {"hi": 0, "lo": 0b1}
    assert holds([hi, lo], {}) == {"hi": 0, "lo": 0}  # idle: nobody holds


def test_high_priority_is_never_held_for_lower_or_equal_priority() -> None:
    hi, lo, lo2 = owner("hi", 0, "GPU-a"), owner("lo", 1, "GPU-a"), owner("lo2", 1, "GPU-a")
    busy = {"lo": frozenset({0}), "lo2": frozenset({0})}
    assert holds([hi, lo, lo2], busy) == {"hi": 0, "lo": 0, "lo2": 0}
    hi2 = owner("hi2", 0, "GPU-a")
    assert holds([hi, hi2], {"hi": frozenset({0}), "hi2": frozenset({0})}) == {"hi": 0, "hi2": 0}


def test_holds_are_per_card() -> None:
    hi = owner("hi", 0, "GPU-a")
    other = owner("other", 1, "GPU-b")
    both = owner("both", 1, "GPU-b", "GPU-a")  # device 1 is the busy card
    assert holds([hi, other, both], {"hi": frozenset({0})}) == {"hi": 0, "other": 0, "both": 0b10}
    # busy on its second device only: the card of that device, not its first
    wide = owner("wide", 0, "GPU-b", "GPU-a")
    assert holds([wide, other, both], {"wide": frozenset({1})}) == {
        "wide": 0,
        "other": 0,
        "both": 0b10,
    }


def test_containers_without_a_priority_take_no_part() -> None:
    plain, lo = owner("plain", None, "GPU-a"), owner("lo", 1, "GPU-a")
    assert holds([plain, lo], {"plain": frozenset({0})}) == {"lo": 0}
    hi = owner("hi", 0, "GPU-a")
    assert "plain" not in holds([plain, hi], {"hi": frozenset({0})})


# --- who is busy ------------------------------------------------------------------------------


def counts(n: int) -> tuple[int, ...]:
    return (n,) + (0,) * (sr.MAX_DEVICES - 1)


def test_busy_means_the_count_moved_within_the_window() -> None:
    a = Activity(busy_ns=300 * MS)
    assert a.observe("x", 1, counts(5), 0) == frozenset()  # first sight: nothing to compare
    assert a.observe("x", 1, counts(9), 100 * MS) == {0}
    assert a.observe("x", 1, counts(9), 350 * MS) == {0}  # still within 300 ms of the move
    assert a.observe("x", 1, counts(9), 401 * MS) == frozenset()
    assert a.observe("x", 1, counts(10), 500 * MS) == {0}
    # a re-created region (another inode) starts again
    assert a.observe("x", 2, counts(0), 510 * MS) == frozenset()


# --- the monitor against region files -------------------------------------------------------


class Node:
    """Owner records written by the plugin's own Writer, regions as a v2 shim makes them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.layout = edits.Layout(
            dev_root=root / "dev",
            region_dir=root / "regions",
            region_container_dir="/var/run/tessera",
            state_dir=root / "state",
            config_container_dir="/etc/tessera",
            shim_library=root / "libtessera.so",
            shim_container_path="/usr/local/tessera/lib/libtessera.so",
            preload=False,
        )
        self.writer = Writer("cdi", root / "cdi", "tessera.io/gpu", self.layout, [])
        self.writer.prepare()
        self.cards = {u: Card(u, i, "A100", 81920, i, 0) for i, u in enumerate(["GPU-a", "GPU-b"])}
        self.now = 1_000_000 * MS
        self.monitor = PriorityMonitor(
            self.layout.state_dir, self.layout.region_dir, 0.1, 0.3, clock=lambda: self.now
        )

    def container(
        self, name: str, priority: int | None, *uuids: str, version: int = sr.REGION_VERSION
    ) -> Path:
        c = ContainerAllocation(
            "app", 0, False, tuple(SliceDevice(u, 100, 0) for u in uuids), priority
        )
        self.writer.write(edits.make_plan(name, c, self.cards, namespace="ns", pod=f"pod-{name}"))
        region = blank_region() if version >= 3 else blank_region_v2(version)
        path = self.layout.region_host_dir(name) / edits.REGION_FILE
        path.write_bytes(bytes(region))
        return path

    def launch(self, name: str, device: int = 0, n: int = 1) -> None:
        path = self.layout.region_host_dir(name) / edits.REGION_FILE
        data = path.read_bytes()
        region = (sr.Region if len(data) == sr.REGION_SIZE else sr.RegionV2).from_buffer_copy(data)
        region.dev[device].launches += n
        path.write_bytes(bytes(region))

    def hold(self, name: str) -> tuple[int, int]:
        snap = sr.read_region(self.layout.region_host_dir(name) / edits.REGION_FILE)
        return snap.hold_mask, snap.hold_until_ns

    def tick(self, advance_ms: int = 100) -> dict[str, int]:
        self.now += advance_ms * MS
        return self.monitor.tick()


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_monitor_holds_the_low_priority_region_while_the_high_one_launches(node: Node) -> None:
    node.container("hi", 0, "GPU-a")
    node.container("lo", 1, "GPU-a")
    node.container("other", 1, "GPU-b")
    assert node.tick() == {"hi": 0, "lo": 0, "other": 0}  # first look: nothing moved yet
    node.launch("hi")
    node.tick()
    mask, until = node.hold("lo")
    assert mask == 0b1
    assert until == node.now + LEASE_POLLS * 100 * MS
    assert node.hold("hi")[0] == 0 and node.hold("other")[0] == 0
    # renewed while the hold stands
    node.launch("hi")
    node.tick()
    assert node.hold("lo") == (0b1, node.now + LEASE_POLLS * 100 * MS)
    # high goes idle: the hold lasts the busy window (300 ms) after its last launch, then goes
    node.tick()
    node.tick()
    assert node.hold("lo")[0] == 0b1
    node.tick()
    assert node.hold("lo")[0] == 0
    # and comes back when it is busy again
    node.launch("hi", n=50)
    assert node.tick()["lo"] == 0b1


def test_low_priority_activity_never_holds_the_high_priority_region(node: Node) -> None:
    node.container("hi", 0, "GPU-a")
    node.container("lo", 1, "GPU-a")
    node.tick()
    for _ in range(5):
        node.launch("lo", n=100)
        node.tick()
        assert node.hold("hi") == (0, 0)  # never written at all


def test_a_hold_is_per_device_of_the_container(node: Node) -> None:
    node.container("hi", 0, "GPU-b")
    node.container("lo", 1, "GPU-a", "GPU-b")
    node.tick()
    node.launch("hi")
    node.tick()
    assert node.hold("lo")[0] == 0b10  # its device 1 is GPU-b


def test_a_restarted_plugin_lifts_a_hold_no_one_needs(node: Node) -> None:
    path = node.container("lo", 1, "GPU-a")
    fd = os.open(path, os.O_RDWR)
    sr.write_hold(fd, 0b1, node.now + 10_000 * MS)  # left by a predecessor
    os.close(fd)
    node.container("hi", 0, "GPU-a")
    node.tick()
    assert node.hold("lo")[0] == 0


def test_release_all_lifts_the_holds_it_set(node: Node) -> None:
    node.container("hi", 0, "GPU-a")
    node.container("lo", 1, "GPU-a")
    node.tick()
    node.launch("hi")
    node.tick()
    assert node.hold("lo")[0] == 0b1
    node.monitor.release_all()
    assert node.hold("lo")[0] == 0


def test_regions_it_must_not_touch_are_left_alone(node: Node) -> None:
    node.container("hi", 0, "GPU-a")
    # a held container replaced its region with a link to another tenant's (a host path), to
    # have its hold written there instead
    victim = node.container("bystander", 1, "GPU-b")
    victim_before = victim.read_bytes()
    link = node.container("linked", 1, "GPU-a")
    link.unlink()
    link.symlink_to(victim)
    # ... truncated its region
    short = node.container("short", 1, "GPU-a")
    short.write_bytes(short.read_bytes()[:1000])
    short_before = short.read_bytes()
    # ... or still runs a version 1 shim, which neither counts nor holds
    old = node.container("old", 1, "GPU-a", version=1)
    before = old.read_bytes()
    node.tick()
    node.launch("hi")
    masks = node.tick()
    assert set(masks) == {"hi", "bystander"}
    assert victim.read_bytes() == victim_before
    assert short.read_bytes() == short_before
    assert old.read_bytes() == before


def test_containers_without_a_priority_are_not_read(node: Node) -> None:
    node.container("hi", 0, "GPU-a")
    plain = node.container("plain", None, "GPU-a")
    node.tick()
    node.launch("hi")
    assert "plain" not in node.tick()
    assert sr.read_region(plain).hold_mask == 0
