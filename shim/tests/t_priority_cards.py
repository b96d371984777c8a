"""Task priority across containers: real shims in "containers" (processes, each with its own
region, on fake cards shared through FAKE_GPU_STATE) and the node plugin's own priority
monitor (nodeplugin/priority.py, standard library only) deciding who holds.

    t_priority_cards.py CASE

  yield   a low-priority container is held while a high-priority one on its card is busy, and
          launches again once that one is idle (stopped), then is held again
  high    a high-priority container is never held for a busy low-priority one: it launches at
          once and its region is never asked to hold
  cards   containers on different cards do not hold each other
  stale   when the monitor dies (stops renewing), a held container launches again within the
          lease, though the high-priority one is still busy
  unset   a container without a priority is never held and counts nothing

Each "container" is a t_launch process (shim/tests/t_launch.c) that launches flat out, paced by
the fake card (1 ms kernels, a queue of 4), and reports its progress in a file. Exits 0 when
the case holds, 1 with a message when it does not.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

SHIM = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SHIM.parent))  # the node plugin's modules, from this checkout

from nodeplugin import edits  # noqa: E402
from nodeplugin import shared_region as sr  # noqa: E402
from nodeplugin.allocation import ContainerAllocation, SliceDevice  # noqa: E402
from nodeplugin.cards import Card  # noqa: E402
from nodeplugin.priority import PriorityMonitor  # noqa: E402
from nodeplugin.writer import Writer  # noqa: E402

B = SHIM / "build"
POLL_S, BUSY_S = 0.05, 0.3
LEASE_S = 5 * POLL_S
UUIDS = [f"GPU-7e55e2a0-0000-4000-8000-{p:012x}" for p in range(2)]  # the fake's cards


def fail(message: str) -> None:
    print(f"FAIL {message}", file=sys.stderr)
    sys.exit(1)


class Node:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.layout = edits.Layout(
            dev_root=root / "dev",
            region_dir=root / "regions",
            region_container_dir="/var/run/tessera",
            state_dir=root / "state",
            config_container_dir="/etc/tessera",
            shim_library=B / "libtessera.so",
            shim_container_path=str(B / "libtessera.so"),
            preload=False,
        )
        self.writer = Writer("cdi", root / "cdi", "tessera.io/gpu", self.layout, [])
        self.writer.prepare()
        self.cards = {u: Card(u, i, "fake", 16384, i, 0) for i, u in enumerate(UUIDS)}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.monitor = PriorityMonitor(
            self.layout.state_dir, self.layout.region_dir, POLL_S, BUSY_S
        )
        self.running = threading.Event()
        self.thread: threading.Thread | None = None

    def start_monitor(self) -> None:
        self.running.set()

        def loop() -> None:
            while self.running.is_set():
                self.monitor.tick()
                time.sleep(POLL_S)

        self.thread = threading.Thread(target=loop, daemon=True)
        self.thread.start()

    def kill_monitor(self) -> None:
        """The plugin dies: no more ticks, and nothing lifted on the way out."""
        self.running.clear()
        assert self.thread is not None
        self.thread.join()

    def container(self, name: str, card: int, priority: int | None) -> None:
        """What PreStartContainer leaves (owner record, region directory), then the process."""
        c = ContainerAllocation("app", 0, False, (SliceDevice(UUIDS[card], 1024, 0),), priority)
        plan = edits.make_plan(name, c, self.cards, namespace="ns", pod=name)
        self.writer.write(plan)
        env = {
            **os.environ,
            **edits.container_env(plan, self.layout),
            "TESSERA_SHARED_REGION": str(self.region(name)),
            "LD_PRELOAD": str(B / "libtessera.so"),
            "LD_LIBRARY_PATH": str(B / "fake"),
            "FAKE_CUDA_DEVICES": "2",
            "FAKE_GPU_STATE": str(self.root / "cards"),
            "FAKE_KERNEL_US": "1000",
            "FAKE_GPU_QUEUE": "4",
        }
        launcher = [str(B / "t_launch"), str(self.progress(name))]
        self.procs[name] = subprocess.Popen(launcher, env=env)  # noqa: S603 - our own test program
        deadline = time.monotonic() + 10
        while self.done(name) == 0:
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                fail(f"{name} never launched")
            time.sleep(0.01)

    def region(self, name: str) -> Path:
        return self.layout.region_host_dir(name) / edits.REGION_FILE

    def progress(self, name: str) -> Path:
        return self.root / f"{name}.progress"

    def done(self, name: str) -> int:
        try:
            data = self.progress(name).read_bytes()
        except FileNotFoundError:
            return 0
        return struct.unpack("=Q", data)[0] if len(data) == 8 else 0

    def hold_mask(self, name: str) -> int:
        return sr.read_region(self.region(name)).hold_mask

    def rate(self, name: str, seconds: float = 0.6) -> float:
        """Launches per second over the next few tenths of a second."""
        n0 = self.done(name)
        time.sleep(seconds)
        return (self.done(name) - n0) / seconds

    def wait(self, what: str, check: Callable[[], bool], timeout: float = 5.0) -> float:
        t0 = time.monotonic()
        while not check():
            if time.monotonic() - t0 > timeout:
                fail(f"timed out waiting for {what}")
            time.sleep(0.01)
        return time.monotonic() - t0

    def stop(self) -> None:
        self.running.clear()
        for p in self.procs.values():
            with_signal(p, signal.SIGCONT)
            p.kill()
            p.wait()


def with_signal(p: subprocess.Popen[bytes], sig: int) -> None:
    if p.poll() is None:
        p.send_signal(sig)


# A free container on the fake card launches near 1000/s (500/s when it shares); a held one 0.
FREE, HELD = 150.0, 10.0


def case_yield(node: Node) -> None:
    node.start_monitor()
    node.container("lo", 0, 1)
    if node.rate("lo") < FREE:
        fail("the low-priority container alone does not launch")
    node.container("hi", 0, 0)
    node.wait("the hold on the low-priority container", lambda: node.hold_mask("lo") == 1)
    time.sleep(0.1)  # a launch already past the look at the hold may still land
    lo, hi = node.rate("lo"), node.rate("hi")
    if lo > HELD or hi < FREE:
        fail(f"while the high one is busy: low {lo:.0f}/s, high {hi:.0f}/s")
    with_signal(node.procs["hi"], signal.SIGSTOP)  # idle
    took = node.wait(
        "the low-priority container to launch again", lambda: node.rate("lo", 0.1) > FREE
    )
    if took < BUSY_S - 0.1:
        fail(
            f"the low one launched {took:.2f} s after the high one stopped, within its busy window"
        )
    with_signal(node.procs["hi"], signal.SIGCONT)
    node.wait("the hold to come back", lambda: node.hold_mask("lo") == 1)
    time.sleep(0.1)
    if (lo := node.rate("lo")) > HELD:
        fail(f"held again, the low one still launches {lo:.0f}/s")


def case_high(node: Node) -> None:
    node.start_monitor()
    node.container("lo", 0, 1)
    node.container("lo2", 0, 1)
    time.sleep(2 * POLL_S)
    t0 = time.monotonic()
    node.container("hi", 0, 0)  # returns at its first launch
    if (took := time.monotonic() - t0) > 3.0:
        fail(f"the high one's first launch took {took:.1f} s")
    for _ in range(10):
        if (hi := node.rate("hi", 0.15)) < FREE:
            fail(f"the high one launched {hi:.0f}/s beside busy low ones")
        if node.hold_mask("hi") != 0:
            fail("the high one's region was asked to hold")


def case_cards(node: Node) -> None:
    node.start_monitor()
    node.container("hi", 0, 0)
    node.container("lo", 1, 1)  # the other card
    for _ in range(5):
        if (lo := node.rate("lo", 0.2)) < FREE or node.hold_mask("lo") != 0:
            fail(f"the low one on the other card is held ({lo:.0f}/s, mask {node.hold_mask('lo')})")
    node.container("lo0", 0, 1)  # the control: on the busy card, it is held
    node.wait("the hold on the same card", lambda: node.hold_mask("lo0") == 1)


def case_stale(node: Node) -> None:
    node.start_monitor()
    node.container("hi", 0, 0)
    node.container("lo", 0, 1)
    node.wait("the hold", lambda: node.hold_mask("lo") == 1)
    time.sleep(0.2)
    if (lo := node.rate("lo", 0.3)) > HELD:
        fail(f"the held one launches {lo:.0f}/s")
    node.kill_monitor()
    took = node.wait(
        "the low one to launch without a monitor", lambda: node.rate("lo", 0.1) > FREE / 2
    )
    if node.hold_mask("lo") != 1:
        fail("the mask was lifted: this case needs a monitor that died, not one that stopped")
    if took > LEASE_S + 1.0:
        fail(f"it waited {took:.2f} s for a lease of {LEASE_S} s")


def case_unset(node: Node) -> None:
    node.start_monitor()
    node.container("hi", 0, 0)
    node.container("plain", 0, None)
    time.sleep(4 * POLL_S)
    # Held, it would launch none in a window; a busy 2-core machine can slow one window below
    # FREE without any hold, so each window must show launches and their median a free rate.
    rates = sorted(node.rate("plain", 0.2) for _ in range(5))
    if rates[0] <= HELD or rates[2] < FREE:
        shown = ", ".join(f"{r:.0f}" for r in rates)
        fail(f"the container without a priority launches {shown}/s beside a busy high one")
    snap = sr.read_region(node.region("plain"))
    if snap.hold_mask != 0 or any(d.launches for d in snap.devices):
        fail("the container without a priority was asked to hold, or counted launches")


CASES = {
    "yield": case_yield,
    "high": case_high,
    "cards": case_cards,
    "stale": case_stale,
    "unset": case_unset,
}


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        fail(f"usage: {sys.argv[0]} {'|'.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="tessera-prio-") as tmp:
        node = Node(Path(tmp))
        try:
            CASES[sys.argv[1]](node)
        finally:
            node.stop()


if __name__ == "__main__":
    main()
