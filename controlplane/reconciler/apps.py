from django.apps import AppConfig


class ReconcilerConfig(AppConfig):
    name = "controlplane.reconciler"
    label = "reconciler"
    verbose_name = "Reconciler"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Bind shared tasks to Tessera's Celery app in every Django process (see celery.py).
        from controlplane import celery  # noqa: F401
