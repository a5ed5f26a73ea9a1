"""URL map: admin, API (scoring, registry, schema and docs, probes), metrics."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("dashboard/", include("dashboard.urls")),
    path("", include("scoring.api.urls")),
    path("", include("django_prometheus.urls")),
]
