"""The protobuf modules are generated at build time, not checked in."""

from __future__ import annotations

import subprocess
import sys

from nodeplugin import build
from tests.nodeplugin.harness.plugin import REPO


def test_build_step_generates_importable_modules() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "nodeplugin.build"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert build.is_current()
    for rel in build.PROTOS:
        stem = rel.removesuffix(".proto")
        assert (build.GENERATED_DIR / f"{stem}_pb2.py").exists()
        assert (build.GENERATED_DIR / f"{stem}_pb2.pyi").exists()
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "from nodeplugin.pb import dp, pr;"
            "assert dp.DESCRIPTOR.package == 'v1beta1' and pr.DESCRIPTOR.package == 'v1';"
            "f = dp.ContainerAllocateResponse.DESCRIPTOR.fields_by_name;"
            "assert f['cdi_devices'].number == 5 and f['annotations'].number == 4",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr


def test_digest_tracks_the_sources() -> None:
    assert len(build.sources_digest()) == 64
    assert (build.GENERATED_DIR / build.STAMP_NAME).read_text().strip() == build.sources_digest()
