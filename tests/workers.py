"""Real Redis and Celery processes for the reconciler's worker tests.

Shared by tests/reconciler/test_worker.py (the embedded Kubernetes stand-in) and
tests/e2e/test_reconciler_workers.py (the real kube-apiserver of the e2e harness): a Redis of
the test's own, so it can be killed and restarted mid-run, and the command lines of the worker
and beat processes as production runs them.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from e2e.ports import free_port


def wait_for(check: Callable[[], object], timeout: float, what: str) -> float:
    """Poll until `check()` is truthy; returns the seconds it took."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class RedisServer:
    """A Redis server of the test's own, so it can be restarted mid-run (nothing persisted)."""

    def __init__(self, workdir: Path) -> None:
        if not shutil.which("redis-server"):
            pytest.fail("redis-server is not installed: run `scripts/services.sh up` (make test)")
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        wait_for(lambda: _pings(client), 10, "redis-server to start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Kill it if it runs (fixture teardown)."""
        if self.proc and self.proc.poll() is None:
            self.kill()

    def has_key(self, key: str) -> bool:
        """Whether `key` exists; False while the server is away."""
        try:
            return bool(redis.Redis.from_url(self.url).exists(key))
        except redis.RedisError:
            return False


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def celery_args(role: str, name: str, workdir: Path) -> list[str]:
    """`celery -A controlplane.celery` arguments of a worker or a beat named `name`: the
    `tessera` queue as in production, one task at a time (the solo pool) so that two workers
    are two competitors, and the beat's schedule file in `workdir`."""
    if role == "beat":
        return ["beat", "--loglevel=INFO", "-s", str(workdir / f"{name}-schedule")]
    return [
        "worker",
        "--loglevel=INFO",
        "--pool=solo",
        "--queues=tessera",
        f"--hostname={name}@%h",
        "--without-gossip",
        "--without-mingle",
    ]
