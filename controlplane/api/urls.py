"""/api/v1/ routes. Each part keeps its own module so they can grow apart."""

from django.urls import include, path

from controlplane.api import views

urlpatterns = [
    path("nodes/<str:name>/inventory", views.NodeInventoryView.as_view(), name="node-inventory"),
    # operations API: quotas, nodes, cards, slices, bindings (the dashboard app)
    path("", include("controlplane.dashboard.api_urls")),
    # why-pending, and allocations for node plugins (the extender app)
    path("", include("controlplane.extender.api_urls")),
]
