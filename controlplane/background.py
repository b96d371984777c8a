"""The one background worker: work a request hands off its path, done by one thread per queue.

The decision log, bind's confirmations, the snapshot refresher, preemption and pod Events each
own a `Worker`: a daemon thread started by the first `submit` (and again by the next one after it
ended: `stop`, or a fork, whose child inherits no threads), that takes what is queued in batches
and hands each batch, in order, to the owner's handler.

- **Batches.** After the first item of a batch the worker waits `window_s` for more, so that one
  statement writes many rows; a flush or stop cuts the window short, and it is skipped when
  `max_batch` items already wait. A batch holds at most `max_batch` items.
- **Wake-ups.** A submit wakes the thread only when it sleeps waiting for work, or for a flush or
  stop: a thread switch on every submit showed as 5 % of the extender's GIL time under load.
- **Bounded.** Past `max_queued` items, `submit` refuses the item (False); its owner says what that
  means (dropped and counted, or done on the caller's path).
- **Flush and stop.** `flush` waits until everything submitted before it was handled; `stop`
  handles what is queued, runs `close` and ends the thread.
- **Idle.** After `idle_s` with nothing to do the thread runs `close` (gives its database
  connection back) and keeps waiting.
- **Timers.** `due` says in how many seconds the handler wants to run with nothing queued (None:
  it does not): the worker then calls it with an empty batch (held decisions whose hold ended,
  the snapshot's periodic pass).
- **Failures.** A handler's exception never ends the thread: it is logged, `close` runs (a
  broken connection is opened afresh), and the batch is dropped, or, with `retry`, handled again
  after `retry(failures)` seconds together with what arrived meanwhile, until it succeeds.
  `backoff_delay` is the one rule for that delay: exponential, capped, full jitter.

Retrying here rather than as a Celery task (as the reconciler's tasks do) is deliberate: the work
is done in the process that queued it, in batches of up to `max_batch` rows per statement, and a
task per item would put a broker round trip on the request path it left.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def backoff_delay(failures: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait after the `failures`-th failure in a row: full jitter, uniform in
    [0, min(cap_s, base_s * 2**failures)], so that many retrying writers spread out."""
    return random.uniform(0, min(cap_s, base_s * 2**failures))


class _Marker:
    """A flush or stop in the queue: released once everything before it was handled."""

    __slots__ = ("done", "stop")

    def __init__(self, *, stop: bool = False) -> None:
        self.done = threading.Event()
        self.stop = stop


class Worker(Generic[T]):
    """One background thread and its queue; thread-safe. See the module doc."""

    def __init__(
        self,
        name: str,
        handle: Callable[[list[T]], None],
        *,
        max_batch: int = 1,
        window_s: float = 0.0,
        max_queued: int | None = None,
        idle_s: float = 30.0,
        close: Callable[[], None] | None = None,
        due: Callable[[], float | None] | None = None,
        retry: Callable[[int], float] | None = None,
    ) -> None:
        self.name = name
        self.handle = handle
        self.max_batch = max_batch
        self.window_s = window_s
        self.max_queued = max_queued
        self.idle_s = idle_s
        self.close = close
        self.due = due
        self.retry = retry
        # Items wait in a deque (append and popleft are atomic under the GIL): a queue.Queue
        # notifies the waiting thread on every put.
        self._items: deque[T | _Marker] = deque()
        self._wake = threading.Event()
        self._idle = False  # the thread sleeps waiting for work: the next submit wakes it
        # How many submits woke the sleeping thread (a diagnostic: submits in a batch window
        # ride along without a wake each; concurrent submits may each count one).
        self.submit_wakeups = 0
        self._urgent = 0  # flushes and stops queued: while any is, no batch window
        self._urgent_lock = threading.Lock()
        self._in_flight = 0  # items of the batch being handled
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread now running, or the last one (None before the first start)."""
        return self._thread

    @property
    def alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    @property
    def queued(self) -> int:
        """Items waiting (flush and stop markers included)."""
        return len(self._items)

    @property
    def pending(self) -> int:
        """Items submitted and not yet handled (O(1): the deque is not walked, which another
        thread may change meanwhile)."""
        return max(0, len(self._items) - self._urgent) + self._in_flight

    def start(self) -> bool:
        """Start the thread unless it runs; True when this call started it."""
        if self.alive:
            return False
        with self._start_lock:
            if self.alive:
                return False
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
            return True

    def wake(self) -> None:
        """Look at `due` again now (its owner's timer changed)."""
        self._wake.set()

    def submit(self, item: T) -> bool:
        """Queue the item; False (and not queued) when `max_queued` items already wait."""
        if self.max_queued is not None and len(self._items) >= self.max_queued:
            return False
        self._items.append(item)
        self.start()
        if self._idle:
            self._idle = False  # one wake is enough until the thread looks again
            self.submit_wakeups += 1
            self._wake.set()
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted so far was handled; False if that took past
        `timeout`."""
        if not self.alive and not self._items:
            return True
        marker = _Marker()
        self._queue_urgent(marker)
        return marker.done.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Handle what is queued, run `close`, end the thread (the next submit starts one)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return
        self._queue_urgent(_Marker(stop=True))
        thread.join(timeout)

    def _queue_urgent(self, marker: _Marker) -> None:
        with self._urgent_lock:
            self._urgent += 1
            self._items.append(marker)
        self.start()
        self._wake.set()

    # --- the thread ------------------------------------------------------------------------

    def _wait_for_work(self) -> bool:
        """Sleep until something is queued (True) or a timer of `due` ends (False); run `close`
        after each `idle_s` with nothing to do."""
        while True:
            due = self.due() if self.due is not None else None
            if due is not None and due <= 0:
                return False
            self._idle = True  # before looking: a submit after the look sees it and wakes us
            woken = bool(self._items) or self._wake.wait(
                self.idle_s if due is None else min(due, self.idle_s)
            )
            self._idle = False
            self._wake.clear()
            if self._items:
                return True
            if not woken and due is None and self.close is not None:
                self.close()  # idle: give the connection back

    def _take(self, batch: list[T], markers: list[_Marker]) -> None:
        """Move queued items into the batch, up to `max_batch`, and the markers among them;
        a stop marker ends the batch."""
        items = self._items
        while items and len(batch) < self.max_batch:
            item = items.popleft()
            if isinstance(item, _Marker):
                with self._urgent_lock:
                    self._urgent -= 1
                markers.append(item)
                if item.stop:
                    break
            else:
                batch.append(item)
        self._in_flight = len(batch)

    def _run(self) -> None:
        while True:
            if not self._wait_for_work():
                self._handle([])  # a timer of `due` ended
                continue
            # Gather what arrives for a moment: one write of many rows costs about what one of
            # a single row does.
            if not self._urgent and len(self._items) < self.max_batch and self.window_s > 0:
                self._wake.wait(self.window_s)  # only a flush or stop cuts it short
                self._wake.clear()
            batch: list[T] = []
            markers: list[_Marker] = []
            self._take(batch, markers)
            if batch:
                self._handle(batch, markers)
            for marker in markers:
                marker.done.set()
            if any(marker.stop for marker in markers):
                if self.close is not None:
                    self.close()
                return

    def _handle(self, batch: list[T], markers: list[_Marker] | None = None) -> None:
        """Hand the batch to the handler; with `retry`, until it succeeds."""
        failures = 0
        try:
            while True:
                try:
                    self.handle(batch)
                    return
                except Exception:
                    failures += 1
                    log.exception(
                        "%s: handling a batch of %d failed (attempt %d)", self.name, len(batch),
                        failures,
                    )  # fmt: skip
                    if self.close is not None:
                        self.close()  # a broken connection is opened afresh next time
                    if self.retry is None:
                        return
                    time.sleep(self.retry(failures))
                    if markers is not None:
                        self._take(batch, markers)  # what arrived meanwhile goes with it
        finally:
            self._in_flight = 0
