"""Unix socket files the kubelet dials: whose a path is, and the leftovers of killed plugins.

Both kubelet APIs (the device plugin's and DRA's) are served on a socket of the process's own,
given a well-known name by a hard link renamed into place; a plugin compares inodes to tell its
own socket from a successor's before removing one.
"""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path


def inode(path: Path) -> tuple[int, int] | None:
    """The file at ``path`` (device, inode), or None when there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def remove_dead_sockets(directory: Path, pattern: str) -> None:
    """Sockets matching ``pattern`` left by a plugin that was killed: nothing listens there."""
    for stale in directory.glob(pattern):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(stale))
                continue  # a live plugin's (a predecessor still terminating)
            except OSError:
                pass
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
