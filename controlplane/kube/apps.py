from django.apps import AppConfig


class KubeConfig(AppConfig):
    name = "controlplane.kube"
    label = "kube"
    verbose_name = "Kubernetes adapter and the embedded stand-in"
    default_auto_field = "django.db.models.BigAutoField"
