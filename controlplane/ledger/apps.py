from django.apps import AppConfig


class LedgerConfig(AppConfig):
    name = "controlplane.ledger"
    label = "ledger"
    verbose_name = "GPU ledger"
    default_auto_field = "django.db.models.BigAutoField"
