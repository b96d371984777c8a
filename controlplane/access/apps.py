from django.apps import AppConfig


class AccessConfig(AppConfig):
    name = "controlplane.access"
    label = "access"
    verbose_name = "Access: API tokens and roles"
    default_auto_field = "django.db.models.BigAutoField"
