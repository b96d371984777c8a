"""The DRA plugin's socket names (pure: the settings check them at start).

The kubelet dials the registration socket under its well-known name in the registry directory
and the endpoint that registration names; both are bound per start under names of their own
(docs/dra.md, *Serving, registration, publishing*).
"""

from __future__ import annotations

import os
from pathlib import Path

from nodeplugin.dra_slices import DRIVER

REGISTRATION_SOCKET = f"{DRIVER}-reg.sock"
# A unix socket's path holds at most 107 bytes (sun_path); the per-start names stay short.
MAX_SOCKET_PATH = 107
TOKEN_HEX = 8


def endpoint_name(token: str) -> str:
    return f"dra-{token}.sock"


def private_registration_name(token: str) -> str:
    """The registration socket's name before it is renamed into place: a dot-file, which the
    kubelet's plugin watcher skips."""
    return f".{DRIVER}-{token}"


def longest_socket_path(registry_dir: Path, plugin_dir: Path) -> int:
    """The longest socket path the plugin binds under these directories, in bytes."""
    token = "0" * TOKEN_HEX
    paths = (
        plugin_dir / endpoint_name(token),
        registry_dir / private_registration_name(token),
        registry_dir / REGISTRATION_SOCKET,
    )
    return max(len(os.fsencode(p)) for p in paths)
