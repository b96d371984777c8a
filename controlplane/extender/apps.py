from django.apps import AppConfig

from controlplane.ledger.allocation import check_production_key


class ExtenderConfig(AppConfig):
    name = "controlplane.extender"
    label = "extender"
    verbose_name = "Scheduler extender and admission webhook"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # A production extender must not start without the allocation key: failing here stops
        # the process at boot instead of failing the first bind.
        check_production_key()
