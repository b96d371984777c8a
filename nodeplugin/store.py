"""Small on-disk state: atomic file writes and the names Allocate issued per set of IDs.

The kubelet caches Allocate's answer and calls PreStartContainer with nothing but the device
IDs, on every start of the container, possibly after this plugin restarted. So the names
Allocate issued are kept on disk (``<state dir>/allocs/<digest>.json``), newest last.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MAX_NAMES = 32


def atomic_write(path: Path, data: bytes, mode: int = 0o644, *, durable: bool = False) -> None:
    """Write to a temporary name in the same directory and rename it into place.

    Watchers (containerd's CDI cache) only ever see a complete file. ``durable`` adds an fsync
    for what must outlive a node crash (the names store: the kubelet checkpoints Allocate's
    answers across reboots); CDI specs and the rest are rewritten by the next
    PreStartContainer anyway.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass(frozen=True)
class IssuedName:
    name: str
    issued_unix: float


class NameStore:
    """Names issued by Allocate, per sorted set of device IDs."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "allocs"
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, digest: str) -> Path:
        return self.dir / f"{digest}.json"

    def names(self, digest: str) -> list[IssuedName]:
        try:
            data = json.loads(self._path(digest).read_bytes())
            return [IssuedName(str(n["name"]), float(n["issued_unix"])) for n in data["names"]]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"state file {self._path(digest)} is unreadable ({exc})") from exc

    def add(self, digest: str, ids: list[str], name: str) -> None:
        try:
            names = self.names(digest)
        except StoreError:
            names = []  # a corrupt record only loses old names; the new one is what matters
        names.append(IssuedName(name, time.time()))
        body = {
            "ids": ids,
            "names": [{"name": n.name, "issued_unix": n.issued_unix} for n in names[-MAX_NAMES:]],
        }
        atomic_write(self._path(digest), json.dumps(body).encode(), durable=True)

    def digests(self) -> list[str]:
        return [p.stem for p in self.dir.glob("*.json")]

    def ids(self, digest: str) -> list[str]:
        try:
            return [str(i) for i in json.loads(self._path(digest).read_bytes())["ids"]]
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def remove(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(digest).unlink()


class StoreError(RuntimeError):
    pass
