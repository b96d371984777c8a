"""Loopback ports: a free one for a server to bind, and whether one is free or listened on.

The one place the harness, the tests and the benchmarks take a port from: it imports only the
standard library and the harness's error.
"""

from __future__ import annotations

import errno
import socket

from e2e.harness import HarnessError


def free_port(taken: set[int] | None = None) -> int:
    """A port of 127.0.0.1 that nothing listens on, and not in `taken` (to which it is added,
    so that the ports handed out for one run are all different)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if taken is None:
            return port
        if port not in taken:
            taken.add(port)
            return port


def _bind(port: int) -> None:
    """Bind 127.0.0.1:`port` as the servers bind: the connections of a server just stopped, left
    in TIME_WAIT, do not keep the port from being listened on again (SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def listening(port: int) -> bool:
    """Whether a server listens on 127.0.0.1:`port` (so that no other can bind it)."""
    try:
        _bind(port)
    except OSError:
        return True
    return False


def ensure_port_free(component: str, port: int) -> None:
    """Fail, naming `component`, when 127.0.0.1:`port` cannot be listened on."""
    try:
        _bind(port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise HarnessError(
                f"{component}: port 127.0.0.1:{port} is already in use by another process; "
                "stop it, or let the harness choose free ports (do not pass this port)"
            ) from None
        raise HarnessError(f"{component}: cannot bind 127.0.0.1:{port}: {exc}") from None
