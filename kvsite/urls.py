"""URL map: admin, API (scoring, registry, schema and docs, probes), metrics."""

from django.contrib import admin
from django.urls import include, path

from scoring.api.metrics import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("dashboard/", include("dashboard.urls")),
    path("", include("scoring.api.urls")),
    path("metrics", metrics_view, name="metrics"),
]
