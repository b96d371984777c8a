"""`manage.py reconcile [--loop] [--period S] [--full] [--prune]`: reconcile without Celery.

Production runs the reconciler as Celery worker + beat (docs/reconciler.md). This command runs
the same pass in-process, for the embedded demo (`make run`, which has no Redis) and for an
operator who wants one pass now. It keeps its resume point in memory. With `--loop` it also
prunes every TESSERA_PRUNE_PERIOD_S, as beat's `prune` does; `--prune` prunes once now too.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser

from controlplane.kube import adapter
from controlplane.reconciler.tasks import LocalState, run_prune, run_reconcile


class Command(BaseCommand):
    help = "Run one reconcile pass (or loop) in this process, without Celery."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--loop", action="store_true", help="Repeat until interrupted.")
        parser.add_argument("--period", type=float, default=float(settings.RECONCILE_PERIOD_S))
        parser.add_argument("--full", action="store_true", help="Always relist everything.")
        parser.add_argument(
            "--prune",
            action="store_true",
            help="Prune too: cards long missing, decision log entries past their use, sessions.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        stop = False

        def _stop(*_: Any) -> None:
            nonlocal stop
            stop = True

        signal.signal(signal.SIGTERM, _stop)
        state = LocalState()
        source = adapter.cluster_source()
        next_prune = time.monotonic() if options["prune"] or options["loop"] else float("inf")
        while True:
            run = run_reconcile(source, state, full=options["full"])
            if run.drift or not options["loop"]:
                self.stdout.write(
                    f"reconcile ({run.mode}, {run.duration_ms} ms, {run.pods_seen} pods): "
                    f"{run.drift or 'no drift'}"
                )
            if time.monotonic() >= next_prune:
                pruned = run_prune()
                next_prune = time.monotonic() + settings.PRUNE_PERIOD_S
                if pruned.cards or pruned.decisions or not options["loop"]:
                    self.stdout.write(
                        f"prune: {len(pruned.cards)} card(s), {pruned.decisions} decision(s)"
                    )
            if not options["loop"] or stop:
                return
            deadline = time.monotonic() + options["period"]
            while not stop and time.monotonic() < deadline:
                time.sleep(0.2)
            if stop:
                return
