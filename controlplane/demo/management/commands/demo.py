"""`manage.py demo`: the embedded demo (DESIGN §7).

`--setup-only`: with no cluster configured (TESSERA_KUBE_MODE resolves to `embedded`), register a
few simulated GPU nodes through the same inventory service node plugins use, and create an admin
user so the operator can sign in. Against a real cluster it only makes sure an admin exists.
Idempotent: rerunning changes nothing but the nodes' heartbeats.

Without it (embedded mode only), after the same set-up it runs a living workload: simulated pods
arrive in the embedded Kubernetes stand-in, go through the real extender endpoints over HTTP on
loopback exactly as kube-scheduler calls them (filter -> prioritize -> bind), run for a while
and end (deleted, their bindings released), while the demo nodes keep reporting like node
plugins. `--url` is the running control plane (`make run` serves it on 127.0.0.1:$PORT).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.access.roles import Role
from controlplane.access.services import grant_role
from controlplane.demo.workload import DemoWorkload
from controlplane.ledger.services.nodes import CardReport, InventoryReport, apply_inventory

DEMO_NODES: dict[str, list[tuple[str, int]]] = {
    "demo-gpu-a100-0": [("NVIDIA A100-SXM4-80GB", 81920)] * 4,
    "demo-gpu-a100-1": [("NVIDIA A100-SXM4-80GB", 81920)] * 4,
    "demo-gpu-l4-0": [("NVIDIA L4", 23034)] * 2,
    "demo-gpu-h100-0": [("NVIDIA H100 80GB HBM3", 81559)] * 8,
}


def demo_report(node: str, cards: list[tuple[str, int]]) -> InventoryReport:
    return InventoryReport(
        plugin_version="demo",
        cards=tuple(
            CardReport(
                uuid=f"GPU-demo-{node}-{i}",
                index=i,
                model=model,
                memory_mib=mib,
                numa_node=i // 4,
                healthy=True,
                health_reason="",
            )
            for i, (model, mib) in enumerate(cards)
        ),
    )


class Command(BaseCommand):
    help = "Set up the embedded demo: simulated GPU nodes (no cluster only) and an admin user."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--setup-only",
            action="store_true",
            help="Register the demo inventory and the admin user, then exit.",
        )
        parser.add_argument(
            "--url",
            default=f"http://127.0.0.1:{os.environ.get('PORT', '8000')}",
            help="The running control plane whose /scheduler/* the workload calls.",
        )
        parser.add_argument("--interval", type=float, default=2.0, help="Seconds per tick.")
        parser.add_argument("--ticks", type=int, default=0, help="Stop after N ticks (0: never).")
        parser.add_argument("--seed", type=int, default=None, help="Random seed (repeatable).")

    def handle(self, *args: Any, **options: Any) -> None:
        password = self._ensure_admin()
        if settings.TESSERA["KUBE_MODE"] == "embedded":
            for node, cards in DEMO_NODES.items():
                apply_inventory(node, demo_report(node, cards), actor="demo")
            self.stdout.write(
                f"demo: {len(DEMO_NODES)} simulated GPU nodes registered "
                f"({sum(len(c) for c in DEMO_NODES.values())} cards)"
            )
        else:
            self.stdout.write(f"cluster mode {settings.TESSERA['KUBE_MODE']}: no demo inventory")
        if password:
            self.stdout.write(f"admin user 'admin', password: {password}")
        if options["setup_only"]:
            return
        if settings.TESSERA["KUBE_MODE"] != "embedded":
            raise CommandError(
                "the demo workload runs only against the embedded stand-in (no cluster "
                "configured); against a real cluster, schedule real pods"
            )
        workload = DemoWorkload(
            options["url"],
            report=lambda: [
                apply_inventory(node, demo_report(node, cards), actor="demo")
                for node, cards in DEMO_NODES.items()
            ],
            log=self.stdout.write,
            seed=options["seed"],
        )
        workload.run(interval=options["interval"], ticks=options["ticks"])

    def _ensure_admin(self) -> str | None:
        """Create 'admin' once; its password comes from TESSERA_ADMIN_PASSWORD or is generated
        and kept (mode 0600) under the local state folder so the next run can show it again."""
        user_model = get_user_model()
        local = Path(settings.LOCAL_DIR)
        local.mkdir(parents=True, exist_ok=True)
        secret_file = local / "admin-password"
        if user_model.objects.filter(username="admin").exists():
            return secret_file.read_text().strip() if secret_file.exists() else None
        password = os.environ.get("TESSERA_ADMIN_PASSWORD") or secrets.token_urlsafe(12)
        user = grant_role("admin", Role.ADMIN)
        user.is_superuser = True
        user.set_password(password)
        user.save()
        secret_file.touch(mode=0o600)
        secret_file.write_text(password + "\n")
        return password
