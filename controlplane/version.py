"""``python -m controlplane.version``: which Tessera this is, for people and image checks.

Prints ``tessera <version> (revision <git revision>)``. The version is the project's
(pyproject.toml); the revision is ``TESSERA_REVISION``, which the images set when they are
built (images/build.sh), else ``unknown``. Imports nothing of Django, so it answers even where
the settings are incomplete.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def version() -> str:
    try:
        return str(tomllib.loads(PYPROJECT.read_text())["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return os.environ.get("TESSERA_VERSION", "unknown")


def main() -> int:
    print(f"tessera {version()} (revision {os.environ.get('TESSERA_REVISION', 'unknown')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
