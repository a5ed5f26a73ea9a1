"""URL map: admin, dashboard, the registry API, the API's schema and docs, metrics; ``/`` is the
dashboard. The scoring endpoints never reach Django (``kvsite.asgi`` sends them to the fast path,
``scoring.fastpath.openapi`` adds them to the schema); the probes, ``/healthz`` and ``/readyz``,
are answered before the Host header is checked (``kvsite.middleware``)."""

from django.contrib import admin
from django.urls import include, path, reverse_lazy
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from kvsite import kv_indexer
from kvsite.metrics import metrics_view

# The admin's "View site" link: the dashboard (operators' home page; staff only, as the admin).
admin.site.site_url = reverse_lazy("dashboard:fleet")

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="dashboard:fleet"), name="home"),
    path("admin/", admin.site.urls),
    path("dashboard/", include("dashboard.urls")),
    path("", include("registry.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    # ReDoc without the web fonts drf-spectacular's page loads from Google (kvsite/templates).
    path(
        "api/redoc/",
        SpectacularRedocView.as_view(url_name="schema", template_name="kvsite/redoc.html"),
        name="api-redoc",
    ),
    path("metrics", metrics_view, name="metrics"),
    # The KV-indexer API's registry writes (its reads are the fast path's: kvsite.asgi).
    path("kv-indexer/register", kv_indexer.RegisterView.as_view(), name="kv-indexer-register"),
    path("kv-indexer/unregister", kv_indexer.UnregisterView.as_view(), name="kv-indexer-unregister"),
]
