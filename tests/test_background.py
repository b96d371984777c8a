"""The one background worker: started on first use, batched, flushed, stopped, closed when idle,
never killed by a failing batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from controlplane.background import Worker, backoff_delay


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Recorder:
    """A handler that records each batch; `gate` (set by default) holds it back while clear."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, batch: list[int]) -> None:
        self.gate.wait(5)
        self.batches.append(list(batch))


def test_it_starts_on_the_first_submit_only() -> None:
    handled = Recorder()
    worker = Worker("test-start", handled)
    assert worker.thread is None and not worker.alive
    assert worker.submit(1)
    assert worker.alive and worker.thread is not None and worker.thread.name == "test-start"
    first = worker.thread
    worker.submit(2)
    assert worker.thread is first  # one thread, not one per submit
    assert worker.flush(5)
    assert handled.batches == [[1], [2]]
    worker.stop()


def test_what_arrives_in_the_window_is_one_batch_and_a_flush_ends_the_window() -> None:
    handled = Recorder()
    worker = Worker("test-batch", handled, max_batch=100, window_s=30.0)
    for i in range(10):
        worker.submit(i)
    started = time.monotonic()
    assert worker.flush(5)
    assert time.monotonic() - started < 5  # the flush cut the 30 s window short
    assert handled.batches == [list(range(10))]
    worker.stop()


def test_a_batch_holds_at_most_max_batch_items_in_order() -> None:
    handled = Recorder()
    handled.gate.clear()  # hold the first batch so that the rest queue up behind it
    worker = Worker("test-max", handled, max_batch=3)
    for i in range(8):
        worker.submit(i)
    handled.gate.set()
    assert worker.flush(5)
    assert [i for batch in handled.batches for i in batch] == list(range(8))
    assert max(len(batch) for batch in handled.batches) <= 3


def test_flush_waits_for_the_batch_in_hand_and_says_when_it_ran_out_of_time() -> None:
    handled = Recorder()
    handled.gate.clear()
    worker = Worker("test-flush", handled)
    worker.submit(1)
    assert wait_for(lambda: worker.queued == 0)  # taken: the handler is at work on it
    assert worker.pending == 1
    assert not worker.flush(0.1)
    handled.gate.set()
    assert worker.flush(5)
    assert handled.batches == [[1]] and worker.pending == 0


def test_flush_of_a_worker_never_started_returns_at_once() -> None:
    worker = Worker("test-idle-flush", Recorder())
    assert worker.flush(0.01)
    assert worker.thread is None


def test_stop_handles_what_is_queued_closes_and_ends_and_a_submit_starts_again() -> None:
    handled = Recorder()
    closed: list[int] = []
    worker = Worker("test-stop", handled, max_batch=10, window_s=30.0,
                    close=lambda: closed.append(1))  # fmt: skip
    for i in range(3):
        worker.submit(i)
    first = worker.thread
    worker.stop(5)
    assert first is not None and not first.is_alive()
    assert handled.batches == [[0, 1, 2]] and closed == [1]
    worker.submit(3)
    assert worker.alive and worker.thread is not first
    assert worker.flush(5)
    assert handled.batches == [[0, 1, 2], [3]]
    worker.stop()


def test_an_idle_worker_closes_and_keeps_waiting() -> None:
    handled = Recorder()
    closed = threading.Event()
    worker = Worker("test-idle", handled, idle_s=0.05, close=closed.set)
    worker.submit(1)
    assert closed.wait(5)  # idle after its batch: its connection given back
    assert worker.alive
    worker.submit(2)
    assert worker.flush(5)
    assert handled.batches == [[1], [2]]
    worker.stop()


def test_a_failing_batch_is_dropped_and_the_worker_goes_on() -> None:
    handled: list[list[int]] = []
    closes: list[int] = []

    def handle(batch: list[int]) -> None:
        if batch == [1]:
            raise RuntimeError("the database went away")
        handled.append(batch)

    worker = Worker("test-error", handle, close=lambda: closes.append(1))
    worker.submit(1)
    assert worker.flush(5)  # a flush behind a failed batch is released too
    worker.submit(2)
    assert worker.flush(5)
    assert handled == [[2]] and closes == [1] and worker.alive
    worker.stop()


def test_with_retry_a_failing_batch_is_handled_again_with_what_arrived_meanwhile() -> None:
    attempts: list[list[int]] = []
    waits: list[int] = []
    worker: Worker[int]

    def handle(batch: list[int]) -> None:
        attempts.append(list(batch))
        if len(attempts) == 1:
            worker.submit(2)  # arrives while the first attempt fails
        if len(attempts) <= 2:
            raise RuntimeError("the database went away")

    def retry(failures: int) -> float:
        waits.append(failures)
        return 0.01

    worker = Worker("test-retry", handle, max_batch=10, retry=retry)
    worker.submit(1)
    assert worker.flush(5)
    assert attempts == [[1], [1, 2], [1, 2]]  # never dropped; the later item joined it
    assert waits == [1, 2] and worker.pending == 0
    worker.stop()


def test_past_max_queued_a_submit_is_refused() -> None:
    handled = Recorder()
    handled.gate.clear()
    worker = Worker("test-bound", handled, max_queued=2)
    worker.submit(0)
    assert wait_for(lambda: worker.queued == 0)  # the thread holds one
    assert worker.submit(1) and worker.submit(2)
    assert not worker.submit(3)
    handled.gate.set()
    assert worker.flush(5)
    assert handled.batches == [[0], [1], [2]]
    worker.stop()


def test_a_submit_wakes_the_thread_only_when_it_sleeps() -> None:
    worker = Worker("test-wakes", Recorder(), max_batch=100, window_s=30.0)
    for i in range(50):
        worker.submit(i)
    assert worker.flush(5)
    assert worker.submit_wakeups <= 1  # at most the first submit (the thread idle), not one each
    worker.stop()


def test_due_runs_the_handler_with_nothing_queued_when_its_timer_ends() -> None:
    ticks: list[list[int]] = []
    at: list[float | None] = [time.monotonic() + 0.1]

    def due() -> float | None:
        when = at[0]
        return None if when is None else when - time.monotonic()

    def handle(batch: list[int]) -> None:
        ticks.append(batch)
        at[0] = None  # one tick, then no timer

    worker = Worker("test-due", handle, due=due)
    worker.start()
    assert wait_for(lambda: ticks == [[]])
    at[0] = time.monotonic()
    worker.wake()  # the timer changed: look again now
    assert wait_for(lambda: ticks == [[], []])
    worker.stop()


@pytest.mark.parametrize("failures", [1, 2, 5, 20])
def test_backoff_is_full_jitter_under_a_growing_capped_bound(failures: int) -> None:
    bound = min(5.0, 0.1 * 2**failures)
    delays = [backoff_delay(failures, 0.1, 5.0) for _ in range(200)]
    assert all(0 <= d <= bound for d in delays)
    assert max(delays) > bound / 2 and min(delays) < bound / 2  # spread, not a fixed wait
