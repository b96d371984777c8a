"""`python -m nodeplugin --version`: what the image checks ask of the entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nodeplugin import __version__

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nodeplugin", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_version_names_the_revision_the_image_was_built_from() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    proc = run("--version", env={**base, "TESSERA_REVISION": "0123abc"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"tessera-nodeplugin {__version__} (revision 0123abc)\n"
    unknown = run("--version", env=base)
    assert unknown.stdout.endswith("(revision unknown)\n")


def test_without_version_it_runs_the_plugin() -> None:
    """Anything else is the plugin itself: with no control plane configured it stops (exit 2)
    naming the setting, rather than printing a version."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    proc = run(env=base)
    assert proc.returncode == 2
    assert "TESSERA_CONTROLPLANE_URL" in proc.stderr
