"""The dashboard's own rows: periodic samples of cluster allocation for the overview's charts.

The ledger holds only the present; the charts need the past. A sample is one row per minute
(`bucket` is unique), so any number of replicas and page views record at most one per minute.
"""

from __future__ import annotations

from django.db import models


class AllocationSample(models.Model):
    """Cluster-wide capacity and allocation at one minute, written by `record_allocation_sample`."""

    bucket = models.DateTimeField(unique=True, help_text="The minute sampled (seconds zeroed).")
    cards = models.PositiveIntegerField()
    memory_total_mib = models.PositiveBigIntegerField()
    memory_allocated_mib = models.PositiveBigIntegerField()
    compute_total = models.PositiveBigIntegerField(help_text="Sum of cards' compute units.")
    compute_allocated = models.PositiveBigIntegerField()
    slices = models.PositiveIntegerField()
    pending_pods = models.PositiveIntegerField()

    class Meta:
        ordering = ["-bucket"]

    def __str__(self) -> str:
        return f"{self.bucket:%Y-%m-%d %H:%M} {self.memory_allocated_mib}/{self.memory_total_mib}"
