"""WSGI entry point for the production app servers (gunicorn controlplane.wsgi; granian
controlplane.wsgi:application for the scheduler's extender sidecar).

The extender's four verbs skip Django's middleware (controlplane/extender/fastpath.py)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
application = get_wsgi_application()

from controlplane.extender.fastpath import ExtenderFastPath  # noqa: E402 - needs the apps loaded

application = ExtenderFastPath(application)
