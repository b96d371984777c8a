"""A PostgreSQL and a Redis of one harness run's own, which it can stop and start by pid.

They are started by `scripts/services.sh` (the same code path as the test suite's pair) with a
folder and ports of their own, so stopping them disturbs nothing else on the machine. Each stop
signals the server's pid (read from what the script prints) and waits until that process has
ended; each start runs the script again on the same folder, so the data survive: PostgreSQL's
cluster, and Redis's append-only file (`TESSERA_REDIS_PERSIST=1`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from e2e.harness import ROOT, HarnessError, log
from e2e.ports import free_port
from e2e.processes import ended

SCRIPT = ROOT / "scripts" / "services.sh"


class Services:
    """PostgreSQL (database `database`) and Redis in `folder`, on free loopback ports."""

    def __init__(self, folder: Path, database: str = "tessera") -> None:
        self.folder = folder
        self.database = database
        taken: set[int] = set()
        self.pg_port = free_port(taken)
        self.redis_port = free_port(taken)
        self.pids: dict[str, int] = {}

    @property
    def database_url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.pg_port}/{self.database}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def _script(self, what: str) -> dict[str, str]:
        """Run `services.sh what` on this pair's folder and ports; the exports it prints."""
        env = {
            **os.environ,
            "TESSERA_SERVICES_DIR": str(self.folder),
            "TESSERA_PG_PORT": str(self.pg_port),
            "TESSERA_REDIS_PORT": str(self.redis_port),
            "TESSERA_PG_DB": self.database,
            "TESSERA_REDIS_PERSIST": "1",
        }
        proc = subprocess.run(  # noqa: S603 - the project's own script
            [str(SCRIPT), what], env=env, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise HarnessError(f"scripts/services.sh {what} failed:\n{proc.stderr[-2000:]}")
        exports = {}
        for line in proc.stdout.splitlines():
            key, _, value = line.removeprefix("export ").partition("=")
            exports[key] = value
        return exports

    def up(self) -> None:
        """Both servers on a fresh folder, and the database."""
        if self.folder.exists():
            shutil.rmtree(self.folder)
        self.start("postgres")
        self.start("redis")
        import psycopg

        with psycopg.connect(
            f"postgres://postgres@127.0.0.1:{self.pg_port}/postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')

    def start(self, server: str) -> float:
        """Start `postgres` or `redis` (again) on its folder; the seconds it took."""
        started = time.monotonic()
        exports = self._script(server)
        key = "TESSERA_PG_PID" if server == "postgres" else "TESSERA_REDIS_PID"
        if not exports.get(key, "").isdigit():
            raise HarnessError(f"scripts/services.sh {server} printed no {key}")
        self.pids[server] = int(exports[key])
        return time.monotonic() - started

    def stop(self, server: str, timeout_s: float = 30.0) -> int:
        """Stop `postgres` (fast shutdown: SIGINT, clients disconnected, nothing lost) or `redis`
        (SIGTERM: it writes its append-only file and exits) by its pid, and wait until it has
        ended. Returns the pid."""
        pid = self.pids.pop(server)
        os.kill(pid, signal.SIGINT if server == "postgres" else signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while not ended(pid):
            if time.monotonic() > deadline:
                raise HarnessError(f"{server} (pid {pid}) did not stop within {timeout_s:.0f} s")
            time.sleep(0.05)
        return pid

    def down(self) -> None:
        """Stop whichever of the two runs (after the cluster that used them)."""
        for server in list(self.pids):
            try:
                self.stop(server)
            except (HarnessError, ProcessLookupError) as exc:
                log(f"stopping the run's {server}: {exc}")
