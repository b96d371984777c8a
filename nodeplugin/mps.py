"""The MPS control daemon of this node's ``mps`` cards: started, watched, restarted.

``nvidia-cuda-mps-control -d`` forks into the background and writes its PID to
``<pipe dir>/nvidia-cuda-mps-control.pid``; the daemon is alive while that PID is (a zombie is
not). The pipe and log directories live under the plugin's state directory and the pipe
directory is mounted into every container with mps slices. A plugin restart adopts a daemon
that still runs for the same cards (the containers' clients are connected to it); a daemon for
another set of cards is told to quit and started again with the new set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

PID_FILE = "nvidia-cuda-mps-control.pid"
DAEMON_NAME = "nvidia-cuda-mps-control"
START_TIMEOUT_S = 10.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.5, 30.0


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # The state is the field after the parenthesised command name; Z and X are dead.
    state = stat.rpartition(")")[2].split()[:1]
    return bool(state) and state[0] not in ("Z", "X")


class MpsDaemon:
    def __init__(self, control: str, state_dir: Path, poll_s: float) -> None:
        self.control = control
        self.base = state_dir / "mps"
        self.pipe_dir = self.base / "pipe"
        self.log_dir = self.base / "log"
        self.cards_file = self.base / "cards"
        self.poll_s = poll_s
        self.healthy = True
        self.reason = ""
        self._backoff = BACKOFF_MIN_S
        self._next_try = 0.0

    def _env(self, cards: Sequence[str]) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": ",".join(cards),
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }

    def pid(self) -> int | None:
        """The running daemon's PID, or None. The PID must still be the daemon's: after the
        plugin's container restarts, the file's PID may name another process of the new one."""
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().strip())
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except (OSError, ValueError):
            return None
        names = {Path(self.control).name, DAEMON_NAME}
        return pid if pid > 0 and Path(argv0).name in names and _alive(pid) else None

    def _running_for(self) -> tuple[str, ...]:
        try:
            return tuple(x for x in self.cards_file.read_text().split(",") if x)
        except OSError:
            return ()

    def _binary(self) -> str:
        found = shutil.which(self.control)
        if found is None:
            raise OSError(f"{self.control} is not found (TESSERA_MPS_CONTROL, PATH)")
        return found

    async def start(self, cards: Sequence[str]) -> None:
        """``nvidia-cuda-mps-control -d`` for ``cards``; returns when the daemon runs."""
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Containers of any user connect to the daemon's pipes.
        os.chmod(self.pipe_dir, 0o755)  # noqa: S103
        with contextlib.suppress(FileNotFoundError):
            (self.pipe_dir / PID_FILE).unlink()
        proc = await asyncio.create_subprocess_exec(
            self._binary(),
            "-d",
            env=self._env(cards),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), START_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise OSError(f"{self.control} -d did not return in {START_TIMEOUT_S:.0f}s") from None
        if proc.returncode != 0:
            text = err.decode(errors="replace").strip()[-300:]
            raise OSError(f"{self.control} -d exited {proc.returncode}: {text}")
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.pid() is None:
            if time.monotonic() > deadline:
                raise OSError(f"{self.control} -d returned but no daemon runs ({PID_FILE})")
            await asyncio.sleep(0.05)
        self.cards_file.write_text(",".join(cards))
        log.info("MPS control daemon %d runs for %s", self.pid(), ", ".join(cards))

    async def quit(self) -> None:
        """Ask the daemon to quit (``quit`` on its control pipe); SIGTERM if it stays."""
        pid = self.pid()
        if pid is None:
            return
        with contextlib.suppress(OSError, TimeoutError):
            proc = await asyncio.create_subprocess_exec(
                self._binary(),
                env=self._env(self._running_for()),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            await asyncio.wait_for(proc.communicate(b"quit\n"), 5.0)
        deadline = time.monotonic() + 5.0
        while _alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(FileNotFoundError):
            self.cards_file.unlink()
        log.info("MPS control daemon %d stopped", pid)

    def _set(self, healthy: bool, reason: str, on_change: Callable[[], None]) -> None:
        if (healthy, reason) != (self.healthy, self.reason):
            self.healthy, self.reason = healthy, reason
            (log.warning if healthy else log.error)(
                "MPS control daemon: %s", "running" if healthy else reason
            )
            on_change()

    async def tick(self, cards: Sequence[str], on_change: Callable[[], None]) -> None:
        """One supervision step (level-based): the daemon runs exactly for ``cards``."""
        want = tuple(sorted(cards))
        pid = self.pid()
        if not want:
            if pid is not None:
                await self.quit()
            self._set(True, "", on_change)
            return
        if pid is not None and self._running_for() == want:
            self._backoff = BACKOFF_MIN_S
            self._set(True, "", on_change)
            return
        if pid is not None:
            log.info("MPS cards are now %s: restarting the daemon", ", ".join(want))
            await self.quit()
        elif self.healthy and self._running_for():
            # Died under us: out at once, and a pause before the restart so that a daemon that
            # dies at every start does not spin.
            self._next_try = time.monotonic() + self._backoff
            self._set(
                False,
                f"MPS control daemon ({self.control}) is not running; restarting it",
                on_change,
            )
        if time.monotonic() < self._next_try:
            return
        try:
            await self.start(want)
        except OSError as exc:
            self._next_try = time.monotonic() + self._backoff
            log.error("MPS control daemon: next start in %.1fs", self._backoff)
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)
            self._set(
                False, f"MPS control daemon ({self.control}) does not start: {exc}", on_change
            )
            return
        self._backoff = BACKOFF_MIN_S
        self._set(True, "", on_change)
