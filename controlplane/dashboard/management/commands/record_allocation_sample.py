"""`manage.py record_allocation_sample`: store this minute's allocation sample for the charts.

The overview page records one as it is viewed; run this from cron or a CronJob (every minute)
so that the charts have no gaps while nobody looks. Safe to run from several places at once:
a minute has at most one sample.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from controlplane.dashboard import selectors, services


class Command(BaseCommand):
    help = "Record this minute's cluster allocation sample (idempotent per minute)."

    def handle(self, *args: Any, **options: Any) -> None:
        sample = services.record_allocation_sample(selectors.cluster_overview())
        self.stdout.write(
            f"{sample.bucket:%Y-%m-%d %H:%M} memory {sample.memory_allocated_mib}/"
            f"{sample.memory_total_mib} MiB, compute {sample.compute_allocated}/"
            f"{sample.compute_total}, {sample.slices} slices, {sample.pending_pods} pending"
        )
