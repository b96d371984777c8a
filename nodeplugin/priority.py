"""Task priority on the node: which containers hold their kernel launches, written into their
regions.

HAMi's rule, per card: a container holds its launches while a container of strictly higher
priority (a lower number) on the same card is busy, i.e. launched kernels within the busy
window. Only containers whose pod asked for a priority take part: the others are never held
and never make anyone hold.

The plugin decides because it is the one party that sees every container on a card, and
because it takes each container's priority from the control plane's record (the owner
records it wrote), never from the container. The shim of a container with a priority counts
its launches per device in its region (``launches``) and holds a launch while the region's
``hold_mask`` has the device's bit and ``hold_until_ns`` lies ahead (shim/README.md, "Task
priority"). Each tick here reads every member's region, sees whose counts moved, and writes
each member's mask; a held member's lease is renewed every tick, so a plugin that dies or
stalls lets its holds go within ``LEASE_POLLS`` polls.

The regions live in directories the containers can write. They are opened without following
links, used only when they are regular files of a region's size, read and written with
``pread``/``pwrite`` (never mapped: a truncated mapping would kill the plugin with SIGBUS),
and a region that is absent, foreign or of version 1 (whose shim neither counts nor holds)
is left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeplugin.edits import REGION_FILE
from nodeplugin.owners import Owner, read_owner
from nodeplugin.shared_region import REGION_SIZES, RegionError, RegionHead, read_head, write_hold

log = logging.getLogger(__name__)

# A hold lasts this many polls unless renewed; the shim ignores one further ahead than 10 s,
# which the largest poll (1 s) keeps clear of.
LEASE_POLLS = 5


def holds(owners: Sequence[Owner], busy: Mapping[str, frozenset[int]]) -> dict[str, int]:
    """The hold mask of each owner with a priority (by name): bit ``i`` when an owner of
    strictly higher priority is busy on the card that is the owner's device ``i``.

    ``busy`` gives, by name, the device ordinals on which an owner launched recently. Owners
    without a priority take no part: they get no mask and hold no one."""
    members = [(o, o.priority) for o in owners if o.priority is not None]
    top: dict[str, int] = {}  # card -> the highest priority (lowest number) busy on it
    for o, priority in members:
        for i in busy.get(o.name, frozenset()):
            if i < len(o.uuids):
                top[o.uuids[i]] = min(top.get(o.uuids[i], priority), priority)
    return {
        o.name: sum(1 << i for i, card in enumerate(o.uuids) if top.get(card, priority) < priority)
        for o, priority in members
    }


class Activity:
    """Who launched recently: per region and device, the last count seen and when it moved.

    A region seen for the first time (or re-created: another inode) is not busy until its
    counts move, one tick later."""

    def __init__(self, busy_ns: int) -> None:
        self.busy_ns = busy_ns
        self._seen: dict[tuple[str, int], tuple[tuple[int, ...], list[int | None]]] = {}

    def observe(
        self, name: str, inode: int, launches: tuple[int, ...], now_ns: int
    ) -> frozenset[int]:
        key = (name, inode)
        previous = self._seen.get(key)
        moved: list[int | None] = [None] * len(launches)
        if previous is not None:
            counts, moved = previous
            moved = [
                now_ns if c != p else m for c, p, m in zip(launches, counts, moved, strict=True)
            ]
        self._seen[key] = (launches, moved)
        return frozenset(
            i for i, m in enumerate(moved) if m is not None and now_ns - m < self.busy_ns
        )

    def keep(self, keys: set[tuple[str, int]]) -> None:
        """Forget regions that are gone."""
        for key in set(self._seen) - keys:
            del self._seen[key]


@dataclass
class _Open:
    owner: Owner
    fd: int
    inode: int
    head: RegionHead


class PriorityMonitor:
    """One tick at a time (``tick``), from the plugin's loop; not thread-safe."""

    def __init__(
        self,
        state_dir: Path,
        region_dir: Path,
        poll_s: float,
        busy_s: float,
        clock: Callable[[], int] = lambda: time.clock_gettime_ns(time.CLOCK_MONOTONIC),
    ) -> None:
        self.owners_dir = state_dir / "owners"
        self.region_dir = region_dir
        self.lease_ns = int(LEASE_POLLS * poll_s * 1e9)
        self.activity = Activity(int(busy_s * 1e9))
        self.clock = clock  # CLOCK_MONOTONIC: the shim compares hold_until_ns with it
        self._owners: dict[str, tuple[tuple[int, int], Owner | None]] = {}
        self._held: dict[str, int] = {}  # name -> mask last written, for the log and release
        self._said: set[tuple[str, str]] = set()

    def members(self) -> list[Owner]:
        """Owners whose pod asked for a priority; a record is re-read only when it changed."""
        seen: dict[str, tuple[tuple[int, int], Owner | None]] = {}
        with contextlib.suppress(FileNotFoundError), os.scandir(self.owners_dir) as it:
            for entry in it:
                if not entry.name.endswith(".json"):
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue
                stamp = (st.st_mtime_ns, st.st_size)
                cached = self._owners.get(entry.name)
                if cached is not None and cached[0] == stamp:
                    seen[entry.name] = cached
                    continue
                try:
                    seen[entry.name] = (stamp, read_owner(Path(entry.path)))
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    self._say(
                        entry.name, f"owner record {entry.path} is unreadable ({exc}); skipped"
                    )
                    seen[entry.name] = (stamp, None)
        self._owners = seen
        return sorted(
            (o for _, o in seen.values() if o is not None and o.priority is not None),
            key=lambda o: o.name,
        )

    def _say(self, name: str, problem: str) -> None:
        if (name, problem) not in self._said:
            self._said.add((name, problem))
            log.warning("task priority: %s", problem)

    def _open(self, owner: Owner) -> _Open | None:
        path = self.region_dir / owner.name / REGION_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None  # no CUDA process yet
        except OSError as exc:
            self._say(owner.name, f"region {path} cannot be opened ({exc.strerror})")
            return None
        try:
            st = os.fstat(fd)
            sizes = sorted(set(REGION_SIZES.values()))
            if not stat.S_ISREG(st.st_mode) or st.st_size not in sizes:
                raise RegionError(f"not a regular file of {' or '.join(map(str, sizes))} bytes")
            head = read_head(fd)
            if not head.can_hold:
                raise RegionError(f"version {head.version}: its shim neither counts nor holds")
            return _Open(owner, fd, st.st_ino, head)
        except (OSError, RegionError) as exc:
            os.close(fd)
            self._say(owner.name, f"region {path} is left alone: {exc}")
            return None

    def tick(self) -> dict[str, int]:
        """Read every member's region, decide, write the masks; returns them by name."""
        now = self.clock()
        opened = [r for r in (self._open(o) for o in self.members()) if r is not None]
        try:
            busy = {
                r.owner.name: self.activity.observe(r.owner.name, r.inode, r.head.launches, now)
                for r in opened
            }
            self.activity.keep({(r.owner.name, r.inode) for r in opened})
            masks = holds([r.owner for r in opened], busy)
            for r in opened:
                self._write(r, masks[r.owner.name], now)
        finally:
            for r in opened:
                os.close(r.fd)
        names = {r.owner.name for r in opened}
        self._held = {name: m for name, m in self._held.items() if name in names}
        return masks

    def _write(self, r: _Open, mask: int, now: int) -> None:
        name = r.owner.name
        try:
            if mask:
                write_hold(r.fd, mask, now + self.lease_ns)
            elif r.head.hold_mask:
                write_hold(r.fd, 0, None)
        except OSError as exc:
            self._say(name, f"region of {name} cannot be written ({exc.strerror})")
            return
        if mask != self._held.get(name, 0):
            o = r.owner
            if mask:
                log.info(
                    "task priority: %s/%s %s (priority %s) holds its launches on %s",
                    o.namespace,
                    o.pod,
                    o.container,
                    o.priority,
                    ", ".join(o.uuids[i] for i in range(len(o.uuids)) if mask >> i & 1),
                )
            else:
                log.info(
                    "task priority: %s/%s %s launches freely again", o.namespace, o.pod, o.container
                )
        self._held[name] = mask

    def release_all(self) -> None:
        """Lift every hold this monitor set (the plugin is stopping): the containers need not
        wait for their leases to run out."""
        for owner in self.members():
            if not self._held.get(owner.name):
                continue
            r = self._open(owner)
            if r is None:
                continue
            # Best effort: a hold that cannot be lifted here still ends with its lease.
            with contextlib.suppress(OSError):
                write_hold(r.fd, 0, None)
            os.close(r.fd)
        self._held.clear()
