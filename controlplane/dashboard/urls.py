"""Dashboard pages, sign-in and /metrics (DESIGN §7: `/` and below for people)."""

from django.contrib.auth import views as auth_views
from django.urls import URLPattern, URLResolver, path

from controlplane.dashboard import metrics, views

app_name = "dashboard"

urlpatterns: list[URLPattern | URLResolver] = [
    path("", views.overview, name="overview"),
    path(
        "login/",
        auth_views.LoginView.as_view(template_name="registration/login.html"),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(next_page="/login/"), name="logout"),
    path("nodes/", views.nodes, name="nodes"),
    path("grid/", views.grid, name="grid"),
    path("nodes/<str:name>/", views.node, name="node"),
    path("nodes/<str:name>/cordon/", views.node_cordon, name="node-cordon"),
    path("cards/<str:uuid>/", views.card, name="card"),
    path("cards/<str:uuid>/cordon/", views.card_cordon, name="card-cordon"),
    path("cards/<str:uuid>/mode/", views.card_mode, name="card-mode"),
    path(
        "cards/<str:uuid>/memory-oversubscription/",
        views.card_factor,
        name="card-memory-oversubscription",
    ),
    path("bindings/", views.bindings, name="bindings"),
    path("pods/<str:namespace>/<str:name>/", views.pod, name="pod"),
    path("quotas/", views.quotas, name="quotas"),
    path("audit/", views.audit, name="audit"),
    path("access/", views.access, name="access"),
    path("api/docs/", views.api_docs, name="api-docs"),
    path("metrics", metrics.MetricsView.as_view(), name="metrics"),
]
