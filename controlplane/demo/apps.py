from django.apps import AppConfig


class DemoConfig(AppConfig):
    name = "controlplane.demo"
    label = "demo"
    verbose_name = "Embedded demo"
