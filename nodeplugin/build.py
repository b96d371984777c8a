"""Generate the protobuf modules for the kubelet APIs into ``nodeplugin/_generated/``.

``python -m nodeplugin.build`` (the Makefile's venv step runs it); :mod:`nodeplugin.pb` also
calls :func:`ensure_generated` on import, so a fresh checkout works without the step. Only
message modules (``api_pb2.py`` + ``.pyi``) are generated: the gRPC plumbing is written by
hand in :mod:`nodeplugin.rpc`, which keeps it typed.

The sources are staged under ``nodeplugin/_generated/`` inside a temporary include root so the
generated modules import each other by their real package path, then the whole folder is
swapped in with a rename: concurrent importers never see a half-written package.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROTO_DIR = PACKAGE_DIR / "proto"
GENERATED_DIR = PACKAGE_DIR / "_generated"
STAMP_NAME = "SOURCES_SHA256"
PROTOS = (
    "deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto",
    "dra/v1/api.proto",
    "pluginregistration/v1/api.proto",
)


class BuildError(RuntimeError):
    """protoc failed or grpcio-tools is missing."""


def sources_digest() -> str:
    """A digest of the .proto sources; the generated folder records the one it was built from."""
    digest = hashlib.sha256()
    for rel in PROTOS:
        digest.update(rel.encode())
        digest.update((PROTO_DIR / rel).read_bytes())
    return digest.hexdigest()


def is_current() -> bool:
    stamp = GENERATED_DIR / STAMP_NAME
    try:
        return stamp.read_text().strip() == sources_digest()
    except OSError:
        return False


def generate() -> Path:
    """Run protoc (from grpcio-tools) and install the result atomically. Returns the folder."""
    try:
        from grpc_tools import protoc
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise BuildError(
            "grpcio-tools is not installed: run `.venv/bin/pip install -e . --group dev` "
            "(it is a dependency in pyproject.toml)"
        ) from exc
    import grpc_tools

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    with tempfile.TemporaryDirectory(prefix=".gen-", dir=PACKAGE_DIR) as tmp:
        stage = Path(tmp) / "include"
        out = Path(tmp) / "out"
        out.mkdir()
        staged: list[str] = []
        for rel in PROTOS:
            target = stage / "nodeplugin" / "_generated" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(PROTO_DIR / rel, target)
            staged.append(str(Path("nodeplugin") / "_generated" / rel))
        args = [
            "protoc",
            f"-I{stage}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            *staged,
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise BuildError(f"protoc failed with exit status {rc}: {' '.join(args)}")
        result = out / "nodeplugin" / "_generated"
        for directory in [result, *(p for p in result.rglob("*") if p.is_dir())]:
            (directory / "__init__.py").touch()
        (result / STAMP_NAME).write_text(sources_digest() + "\n")
        old = Path(tmp) / "old"
        with contextlib.suppress(FileNotFoundError):
            os.rename(GENERATED_DIR, old)
        try:
            os.rename(result, GENERATED_DIR)
        except OSError:
            # Another process installed its copy first; theirs is built from the same sources.
            if not is_current():
                raise
    return GENERATED_DIR


def ensure_generated() -> None:
    """Generate the modules unless an up-to-date copy is already there."""
    if not is_current():
        generate()


def main(argv: list[str] | None = None) -> int:
    """``python -m nodeplugin.build [--force]``: generate unless already current."""
    force = "--force" in (sys.argv[1:] if argv is None else argv)
    if not force and is_current():
        print(f"protobuf modules in {GENERATED_DIR} are up to date")
        return 0
    try:
        path = generate()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"generated protobuf modules in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
