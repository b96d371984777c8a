"""`python -m controlplane.version`: the project's version and the image's revision."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_projects_and_names_the_revision() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_REVISION"}
    proc = subprocess.run(
        [sys.executable, "-m", "controlplane.version"],
        cwd=ROOT,
        env={**env, "TESSERA_REVISION": "feedbeef"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stdout == f"tessera {version} (revision feedbeef)\n"
