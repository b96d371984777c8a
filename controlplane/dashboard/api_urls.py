"""/api/v1/ routes of the operations API: quotas, nodes, cards, slices, bindings, cordons, card
modes, cards' oversubscription factors.

Cordon, mode and factor routes take the path with or without a trailing slash: a POST must
never depend on a redirect.
"""

from django.urls import URLPattern, URLResolver, path, re_path

from controlplane.dashboard import api_views as v

NAME = r"(?P<name>[^/]+)"
UUID = r"(?P<uuid>[^/]+)"

urlpatterns: list[URLPattern | URLResolver] = [
    path("quotas/", v.QuotaListView.as_view(), name="api-quotas"),
    path("quotas/<str:namespace>/", v.QuotaDetailView.as_view(), name="api-quota"),
    path("nodes/", v.NodeListView.as_view(), name="api-nodes"),
    path("nodes/<str:name>/", v.NodeDetailView.as_view(), name="api-node"),
    re_path(
        rf"^nodes/{NAME}/cordon/?$", v.NodeCordonView.as_view(cordon=True), name="api-node-cordon"
    ),
    re_path(
        rf"^nodes/{NAME}/uncordon/?$",
        v.NodeCordonView.as_view(cordon=False),
        name="api-node-uncordon",
    ),
    path("cards/", v.CardListView.as_view(), name="api-cards"),
    path("cards/<str:uuid>/", v.CardDetailView.as_view(), name="api-card"),
    re_path(
        rf"^cards/{UUID}/cordon/?$", v.CardCordonView.as_view(cordon=True), name="api-card-cordon"
    ),
    re_path(
        rf"^cards/{UUID}/uncordon/?$",
        v.CardCordonView.as_view(cordon=False),
        name="api-card-uncordon",
    ),
    re_path(rf"^cards/{UUID}/mode/?$", v.CardModeView.as_view(), name="api-card-mode"),
    re_path(
        rf"^cards/{UUID}/memory-oversubscription/?$",
        v.CardFactorView.as_view(),
        name="api-card-memory-oversubscription",
    ),
    path("slices/", v.SliceListView.as_view(), name="api-slices"),
    path("bindings/", v.BindingListView.as_view(), name="api-bindings"),
]
