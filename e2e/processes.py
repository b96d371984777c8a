"""The harness's processes: start a daemon in a session of its own with its log and the run's
id in its environment, wait until it is ready, and stop it with its descendants by pid.

Processes are read through psutil. A process belongs to a run when its environment carries
`TESSERA_E2E_RUN_ID=<run id>`: that is how a stop tells a component from a process its pid was
reused for, and how `down` finds whatever a run left behind. A component is stopped with its
descendants, found by their parent links, never by process group or session: a group can hold
processes that are not the component's (one that left the tree, or any process a component's
pid was reused for).
"""

from __future__ import annotations

import contextlib
import os
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from pathlib import Path

import psutil

from e2e.harness import ROOT, HarnessError, log

RUN_ID_ENV = "TESSERA_E2E_RUN_ID"


def of_run(pid: int, run_id: str) -> bool:
    """Whether process `pid` runs and carries this run's id in its environment."""
    try:
        return psutil.Process(pid).environ().get(RUN_ID_ENV) == run_id
    except psutil.Error:  # gone, a zombie (no environment left), or not ours to read
        return False


def ended(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie its parent has not reaped."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return True


def processes_of_run(run_id: str) -> list[int]:
    """Every live process whose environment carries this run's id (the orphan sweep)."""
    me = os.getpid()
    return [
        proc.pid
        for proc in psutil.process_iter(["environ", "status"])
        if proc.pid != me
        and (proc.info["environ"] or {}).get(RUN_ID_ENV) == run_id
        and proc.info["status"] != psutil.STATUS_ZOMBIE
    ]


def spawn(
    argv: list[str], log_path: Path, *, run_id: str, env: dict[str, str], cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    """Start `argv` with stdout and stderr appended to `log_path`, this environment over ours,
    and the run's id."""
    with log_path.open("ab") as out:
        return subprocess.Popen(  # noqa: S603 - argv built by the harness from pinned binaries
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **env, RUN_ID_ENV: run_id},
            cwd=cwd,
            # A session of its own: a terminal's signals (Ctrl-C, hang-up) never reach a
            # cluster `e2e-up` left running. Stopped by pid and descendants, not by group.
            start_new_session=True,
        )


def tail(path: Path, lines: int = 25) -> str:
    """The last `lines` lines of a log, indented, for an error message."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:]) or "    (empty log)"


def wait_ready(
    name: str,
    proc: subprocess.Popen[bytes],
    probe: Callable[[], bool],
    *,
    what: str,
    timeout_s: float,
    log_path: Path,
) -> None:
    """Poll `probe()` until it is true; fail with the end of the log when the process exits
    first or `timeout_s` passes (`what` names the probe)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.05
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise HarnessError(
                f"{name} exited with code {code} before it was ready; the end of "
                f"{log_path}:\n{tail(log_path)}"
            )
        if probe():
            return
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
    raise HarnessError(
        f"{name} did not become ready ({what}) within {timeout_s:.0f} s; "
        f"the end of {log_path}:\n{tail(log_path)}"
    )


def http_ok(url: str, context: ssl.SSLContext | None, expect: Callable[[bytes], bool]) -> bool:
    """Whether GET `url` answers 200 with a body that `expect` accepts."""
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:  # noqa: S310
            return bool(resp.status == 200 and expect(resp.read()))
    except (OSError, urllib.error.URLError, ssl.SSLError):
        return False


def probe_context() -> ssl.SSLContext:
    """TLS that accepts a component's self-signed serving certificate: for probes only."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def get_ok(url: str, insecure: bool = False) -> bool:
    """Whether GET `url` answers 200: a readiness probe of a component the harness starts."""
    return http_ok(url, probe_context() if insecure else None, lambda body: True)


def stop_run_process(
    name: str,
    pid: int,
    run_id: str,
    timeout_s: float = 10.0,
    first: signal.Signals = signal.SIGTERM,
) -> None:
    """Stop component `name` of the run: its process and that process's descendants, nothing
    else."""
    if not of_run(pid, run_id):
        return  # gone already (or the pid was reused by someone else: leave that alone)
    if stop_process_tree(pid, timeout_s, first=first) and first != signal.SIGKILL:
        log(f"{name} did not stop within {timeout_s:.0f} s of SIGTERM: killed it")


def _live(proc: psutil.Process) -> bool:
    """Whether `proc` still runs: not ended, not a zombie, and its pid not another process's
    (psutil tells by the start time)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _children() -> dict[int, list[psutil.Process]]:
    """Every live process's children, from one pass over the process table."""
    children: dict[int, list[psutil.Process]] = {}
    for proc in psutil.process_iter(["ppid", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and proc.info["ppid"] is not None:
            children.setdefault(proc.info["ppid"], []).append(proc)
    return children


def stop_process_tree(
    pid: int, timeout_s: float = 10.0, *, first: signal.Signals = signal.SIGTERM
) -> bool:
    """SIGTERM (or `first`) a process and its descendants, wait up to `timeout_s` for all of
    them to end, then SIGKILL those left. Returns whether any had to be killed.

    The tree is taken before the first signal and grown while waiting (a child re-parented to
    init when its parent ends stays known), and each process is kept as psutil knows it, pid and
    start time, so a pid reused meanwhile is never signalled.
    """
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return False
    if not _live(root):
        return False
    tree = {pid: root}  # every process of the tree seen so far

    def running() -> list[psutil.Process]:
        """The tree's processes still running, parents before children, after adding the
        children they have now."""
        children = _children()
        live, queue = [], deque(tree.values())
        while queue:
            proc = queue.popleft()
            if not _live(proc):
                continue
            live.append(proc)
            for child in children.get(proc.pid, ()):
                if child.pid not in tree:
                    tree[child.pid] = child
                    queue.append(child)
        return live

    def send(procs: list[psutil.Process], sig: signal.Signals) -> None:
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                proc.send_signal(sig)  # refuses a pid that is another process's now

    signalled: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        live = running()
        if not live:
            return False
        fresh = [p for p in live if p.pid not in signalled]  # the tree grew: those get it too
        send(fresh, first)
        signalled.update(p.pid for p in fresh)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    send(running(), signal.SIGKILL)
    return True
