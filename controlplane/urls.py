"""URL map of the control plane (DESIGN §7)."""

from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView

from controlplane import health

# An unmatched /api/ path answers the API's JSON error body, not Django's HTML page.
handler404 = "controlplane.api.errors.not_found"

admin.site.site_header = "Tessera control plane"
admin.site.site_title = "Tessera"
admin.site.index_title = "GPU ledger"

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("api/v1/", include("controlplane.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("admin/", admin.site.urls),
    # extender (/scheduler/...) and admission webhook (/webhook/...)
    path("", include("controlplane.extender.urls")),
    # dashboard pages and /metrics (the dashboard owns "/", so it comes last)
    path("", include("controlplane.dashboard.urls")),
]
