"""Tessera's OCI images for the harness and the tests: built by images/build.sh (a no-op when
they are current), pushed to the harness's registry with skopeo, run by buildah for checks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "images" / "build.sh"
ALL = ("controlplane", "nodeplugin", "gpu-test", "pause")


class ImageError(RuntimeError):
    """An image could not be built, pushed or read; the message names which and why."""


@dataclass(frozen=True)
class Image:
    name: str  # controlplane, nodeplugin, gpu-test, pause
    archive: Path  # the OCI archive under .cache/images/
    ref: str  # the name inside it, tessera/<name>:<version>

    @property
    def tag(self) -> str:
        return self.ref.rsplit(":", 1)[1]

    @property
    def repository(self) -> str:
        return self.ref.rsplit(":", 1)[0]


def build(names: tuple[str, ...] = ALL) -> dict[str, Image]:
    """Build (or find current) the images; name -> Image."""
    proc = subprocess.run(  # noqa: S603 - the project's own script
        [str(BUILD), *names], stdout=subprocess.PIPE, text=True, check=False
    )
    if proc.returncode != 0:
        raise ImageError(
            f"image build: images/build.sh {' '.join(names)} failed (exit {proc.returncode}; "
            "its output is above)"
        )
    images = {}
    for line in proc.stdout.splitlines():
        name, archive, ref = line.split(" ")
        images[name] = Image(name, Path(archive), ref)
    missing = set(names) - images.keys()
    if missing:
        raise ImageError(f"image build: images/build.sh printed nothing for {sorted(missing)}")
    return images


def config(image: Image) -> dict[str, object]:
    """The image's OCI configuration (user, env, entrypoint, labels), read from the archive."""
    skopeo = shutil.which("skopeo")
    if skopeo is None:
        raise ImageError("skopeo not found: images/build.sh installs it (apt-get install skopeo)")
    proc = subprocess.run(  # noqa: S603
        [skopeo, "inspect", "--config", f"oci-archive:{image.archive}:{image.ref}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ImageError(f"skopeo inspect of {image.archive} failed: {proc.stderr.strip()}")
    return dict(json.loads(proc.stdout))


def run_argv(image: Image, *command: str, env: dict[str, str] | None = None) -> list[str]:
    """The command line that runs `command` in a container of the image (buildah, chroot)."""
    pairs = [arg for k, v in (env or {}).items() for arg in ("-e", f"{k}={v}")]
    return [str(BUILD), "--run", image.name, *pairs, "--", *command]


def push(image: Image, registry: str) -> str:
    """Push the archive to `registry` (host:port); returns the pushed reference."""
    proc = subprocess.run(  # noqa: S603
        [str(BUILD), "--push", registry, image.name], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise ImageError(
            f"pushing {image.ref} to the registry at {registry} failed:\n{proc.stderr[-2000:]}"
        )
    return f"{registry}/{image.ref}"
