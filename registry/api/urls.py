"""Routes of the registry API and of the OpenAPI schema and docs. The scoring endpoints never
reach Django (``kvsite.asgi`` sends them to the fast path); the probes, ``/healthz`` and
``/readyz``, are answered before the Host header is checked (``kvsite.middleware``)."""

from __future__ import annotations

from django.urls import path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from registry.api import views as registry

urlpatterns = [
    path("api/v1/pods/", registry.PodListView.as_view(), name="pods"),
    path("api/v1/pods/<str:pod_id>/", registry.PodDetailView.as_view(), name="pod"),
    path("api/v1/models/", registry.ModelConfigListView.as_view(), name="model-configs"),
    # Model names contain "/" (e.g. "Qwen/Qwen3-0.6B"): the name is everything up to the last "/".
    re_path(r"^api/v1/models/(?P<name>.+)/$", registry.ModelConfigDetailView.as_view(), name="model-config"),
    path("api/v1/hash-seed/", registry.HashSeedView.as_view(), name="hash-seed"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    # ReDoc without the web fonts drf-spectacular's page loads from Google (scoring/templates).
    path(
        "api/redoc/",
        SpectacularRedocView.as_view(url_name="schema", template_name="kvsite/redoc.html"),
        name="api-redoc",
    ),
]
