"""Extender and admission webhook routes (mounted at the root: /scheduler/*, /webhook/*)."""

from django.urls import URLPattern, URLResolver, path

from controlplane.extender import views

urlpatterns: list[URLPattern | URLResolver] = [
    path("scheduler/filter", views.filter_view, name="extender-filter"),
    path("scheduler/prioritize", views.prioritize_view, name="extender-prioritize"),
    path("scheduler/bind", views.bind_view, name="extender-bind"),
    path("scheduler/preempt", views.preempt_view, name="extender-preempt"),
    path("webhook/mutate", views.mutate_view, name="webhook-mutate"),
    path("webhook/validate-claims", views.validate_claims_view, name="webhook-validate-claims"),
]
