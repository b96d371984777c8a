"""/api/v1/ routes of the extender app: why-pending and allocations (docs/allocation.md)."""

from django.urls import URLPattern, URLResolver, path

from controlplane.extender import api_views

urlpatterns: list[URLPattern | URLResolver] = [
    path("pods/<str:namespace>/<str:name>/why", api_views.WhyView.as_view(), name="pod-why"),
    path(
        "allocations/<str:namespace>/<str:name>",
        api_views.AllocationView.as_view(),
        name="allocation",
    ),
    path(
        "allocations/<str:pod_uid>/containers/<str:container>/allocated",
        api_views.AllocatedView.as_view(),
        name="allocation-allocated",
    ),
]
