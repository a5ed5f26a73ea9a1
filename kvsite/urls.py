"""URL map: admin, API (scoring), dashboard, metrics."""

from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", include("django_prometheus.urls")),
]
