"""The Celery application of the control plane (worker: `celery -A controlplane.celery worker`).

Configured from Django settings (`CELERY_*`), broker `REDIS_URL`. It is not imported from
`controlplane/__init__.py` as Celery's Django guide suggests: that would make every import of the
pure scheduling core (`controlplane.scheduling`) drag Celery in. The reconciler app's `ready()`
imports it instead, so `shared_task`s bind to it in every Django process.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("tessera")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["controlplane.reconciler"])
