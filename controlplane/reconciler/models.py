"""Records of reconcile runs: what drift each run found and repaired.

Kept in the database (not only in process metrics) because the worker that repairs and the web
replica that serves /metrics are different processes; the dashboard and /metrics read these.
"""

from __future__ import annotations

from django.db import models


class ReconcileRun(models.Model):
    """One pass of the reconciler (full relist or incremental watch)."""

    class Mode(models.TextChoices):
        FULL = "full", "full relist"
        WATCH = "watch", "watch events"

    started_at = models.DateTimeField(db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.PositiveIntegerField(null=True, blank=True)
    mode = models.CharField(max_length=8, choices=Mode.choices)
    pods_seen = models.PositiveIntegerField(default=0)
    nodes_seen = models.PositiveIntegerField(default=0)
    drift = models.JSONField(default=dict, help_text="Kind of drift -> number repaired/flagged.")
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"{self.mode} reconcile at {self.started_at:%Y-%m-%d %H:%M:%S}"
