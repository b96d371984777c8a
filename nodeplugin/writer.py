"""Puts a resolved plan on disk: the CDI spec, or the host-path artifacts, plus the region dir."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from nodeplugin import edits
from nodeplugin.edits import ContainerPlan, Layout
from nodeplugin.store import atomic_write


class Writer:
    def __init__(
        self,
        mode: str,
        cdi_dir: Path,
        cdi_kind: str,
        layout: Layout,
        control_devices: Sequence[str],
    ) -> None:
        self.mode = mode
        self.cdi_dir = cdi_dir
        self.cdi_kind = cdi_kind
        self.layout = layout
        self.control_devices = list(control_devices)

    def prepare(self) -> None:
        """Directories and the ``/etc/ld.so.preload`` file every container mounts."""
        self.layout.state_dir.mkdir(parents=True, exist_ok=True)
        (self.layout.state_dir / "owners").mkdir(exist_ok=True)
        self.layout.region_dir.mkdir(parents=True, exist_ok=True)
        if self.mode == "cdi":
            self.cdi_dir.mkdir(parents=True, exist_ok=True)
        if self.layout.preload:
            atomic_write(self.layout.preload_file, f"{self.layout.shim_container_path}\n".encode())

    def cdi_path(self, name: str) -> Path:
        return self.cdi_dir / edits.cdi_file_name(self.cdi_kind, name)

    def write(self, plan: ContainerPlan) -> None:
        region = self.layout.region_host_dir(plan.name)
        region.mkdir(parents=True, exist_ok=True)
        os.chmod(region, 0o777)  # noqa: S103 - the container's user, whoever it is, creates the region file
        owner = {
            "name": plan.name,
            "namespace": plan.namespace,
            "pod": plan.pod,
            "pod_uid": plan.pod_uid,
            "container": plan.container,
            "priority": plan.priority,
            "devices": [
                {"uuid": d.card.uuid, "memory_mib": d.memory_mib, "cores": d.cores}
                for d in plan.devices
            ],
        }
        atomic_write(
            self.layout.state_dir / "owners" / f"{plan.name}.json", json.dumps(owner).encode()
        )
        if self.mode == "cdi":
            self._write_cdi(plan)
        else:
            self._write_paths(plan)

    def _write_cdi(self, plan: ContainerPlan) -> None:
        spec = edits.cdi_spec(self.cdi_kind, plan, self.layout, self.control_devices)
        data = (json.dumps(spec, indent=1, sort_keys=True) + "\n").encode()
        path = self.cdi_path(plan.name)
        with contextlib.suppress(OSError):
            if path.read_bytes() == data:
                return  # same name, same content: nothing a cache could get wrong
        atomic_write(path, data)

    def _write_paths(self, plan: ContainerPlan) -> None:
        base = self.layout.paths_dir(plan.name)
        tmp = base.with_name(f".{base.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "config").mkdir(parents=True)
        (tmp / "dev").mkdir()
        (tmp / "config" / edits.CONFIG_FILE).write_text(edits.paths_config(plan, self.layout))
        for d in plan.devices:
            os.symlink(
                self.layout.dev_root / f"nvidia{d.card.minor}",
                tmp / "dev" / f"nvidia{d.card.minor}",
            )
        if base.exists():
            old = base.with_name(f".{base.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(base, old)
            os.rename(tmp, base)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, base)

    def remove(self, name: str) -> None:
        """Everything written for `name`, the CDI spec last: while the spec exists, what it
        points at does too, and once it is gone nothing of the name is left (a reader that sees
        the spec gone, the runtime or a test, never meets half an allocation)."""
        shutil.rmtree(self.layout.paths_dir(name), ignore_errors=True)
        shutil.rmtree(self.layout.region_host_dir(name), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (self.layout.state_dir / "owners" / f"{name}.json").unlink()
        with contextlib.suppress(FileNotFoundError):
            self.cdi_path(name).unlink()
