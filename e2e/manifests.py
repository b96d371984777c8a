"""What the deployment's manifests say that the harness runs as written: the webhook
registration and the scheduler profile of deploy/, the extender sidecar's command, and that
command as the harness runs it on its own port.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from e2e.harness import ROOT, HarnessError, log


def deployed_webhook_config() -> tuple[dict[str, Any], str] | None:
    """The MutatingWebhookConfiguration shipped in deploy/webhook/, if there is one."""
    folder = ROOT / "deploy" / "webhook"
    for path in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError:
            continue
        for doc in docs:
            if isinstance(doc, dict) and doc.get("kind") == "MutatingWebhookConfiguration":
                return doc, str(path.relative_to(ROOT))
    return None


def deployed_scheduler_config() -> tuple[dict[str, Any], str] | None:
    """The KubeSchedulerConfiguration shipped in deploy/scheduler/ (plain or in a ConfigMap)."""
    folder = ROOT / "deploy" / "scheduler"
    if not folder.is_dir():
        return None
    for path in sorted([*folder.glob("*.yaml"), *folder.glob("*.yml")]):
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError:
            continue  # a Helm template, not plain YAML
        for doc in docs:
            if not isinstance(doc, dict):
                continue
            if doc.get("kind") == "KubeSchedulerConfiguration":
                return doc, str(path.relative_to(ROOT))
            for key, value in (
                (doc.get("data") or {}).items() if doc.get("kind") == "ConfigMap" else []
            ):
                try:
                    inner = yaml.safe_load(value)
                except yaml.YAMLError:
                    continue
                if isinstance(inner, dict) and inner.get("kind") == "KubeSchedulerConfiguration":
                    return inner, f"{path.relative_to(ROOT)} (data.{key})"
    return None


def extender_command_in(docs: Sequence[Any]) -> list[str] | None:
    """The command (and args) of the first Deployment container named `extender` in `docs`."""
    for doc in docs:
        if not isinstance(doc, dict) or doc.get("kind") != "Deployment":
            continue
        spec = ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
        for container in spec.get("containers") or []:
            if container.get("name") == "extender" and container.get("command"):
                return [str(a) for a in [*container["command"], *(container.get("args") or [])]]
    return None


def deployed_extender_command() -> tuple[list[str], str] | None:
    """The extender sidecar's command (and args) in deploy/scheduler/deployment.yaml."""
    path = ROOT / "deploy" / "scheduler" / "deployment.yaml"
    try:
        argv = extender_command_in(list(yaml.safe_load_all(path.read_text())))
    except (OSError, yaml.YAMLError):
        return None
    return (argv, f"{path.relative_to(ROOT)}: the extender container") if argv else None


# The servers the harness can point at its own port, by the module the venv's Python runs:
# their console scripts, and the sidecar's own start of granian (granian's option names, its
# header-read timeout without the command line's ceiling, controlplane/sidecar.py).
SIDECAR_SERVERS = {
    "granian": "granian",
    "gunicorn": "gunicorn",
    "controlplane.sidecar": "granian",
}


def sidecar_server(command: Sequence[str], source: str) -> tuple[str, str, list[str]]:
    """(server, module, arguments) of a sidecar command: `granian ...`, `gunicorn ...`, or
    `python -m <module> ...` for a module of SIDECAR_SERVERS."""
    head = 1
    if len(command) > 2 and Path(command[0]).name in ("python", "python3") and command[1] == "-m":
        head = 3
    module = (command[2] if head == 3 else Path(command[0]).name) if command else ""
    server = SIDECAR_SERVERS.get(module)
    if server is None:
        raise HarnessError(
            f"{source}: the command {list(command)[:head]} is not granian or gunicorn, the "
            "servers the harness knows how to point at its own port"
        )
    args = list(command[head:])
    return server, module, args


def sidecar_argv(command: Sequence[str], port: int, source: str) -> list[str]:
    """The sidecar's command as the harness runs it: the venv's Python runs the server (the
    command names a console script of the image, or `python -m` a module of it), on loopback at
    the harness's port.

    The listening address is the one thing replaced: `--host=`/`--port=` (granian) or `--bind=`
    (gunicorn). A command with neither is refused, as is a server the harness does not know.
    """
    _, module, args = sidecar_server(command, source)
    argv = [sys.executable, "-m", module]
    placed = False
    for arg in args:
        if arg in ("--host", "--port", "--bind", "-b"):
            raise HarnessError(
                f"{source}: {arg} without =value; write the listening options as --name=value, "
                "as the manifests do"
            )
        name = arg.split("=", 1)[0]
        if name == "--host":
            arg = "--host=127.0.0.1"
        elif name == "--port":
            arg, placed = f"--port={port}", True
        elif name == "--bind":
            arg, placed = f"--bind=127.0.0.1:{port}", True
        argv.append(arg)
    if not placed:
        raise HarnessError(
            f"{source}: the command sets no --port= or --bind=, so the harness cannot give it "
            "its own port"
        )
    return argv


def launcher_of(checkout: Path, module: str, argv: list[str]) -> list[str]:
    """The sidecar's argv for another checkout (a bench's variant), whose own `controlplane`
    package comes first on the path: a checkout without the module (controlplane/sidecar.py)
    runs granian's own command line, with granian's default header-read timeout (idle
    connections closed after 30 s)."""
    if (checkout / Path(*module.split("."))).with_suffix(".py").is_file():
        return argv
    log(f"{checkout}: no {module}: its sidecar runs granian's own command line")
    kept = [a for a in argv[3:] if not a.startswith("--http1-header-read-timeout=")]
    return [argv[0], "-m", "granian", *kept]
