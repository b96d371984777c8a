from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "controlplane.dashboard"
    label = "dashboard"
    verbose_name = "Dashboard, operations API and metrics"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Registers the bearer-token scheme with drf-spectacular (import side effect).
        from controlplane.dashboard import schema  # noqa: F401
