"""URL map: admin, dashboard, API (registry, schema and docs), metrics; ``/`` is the dashboard."""

from django.contrib import admin
from django.urls import include, path, reverse_lazy
from django.views.generic import RedirectView

from kvsite.metrics import metrics_view

# The admin's "View site" link: the dashboard (operators' home page; staff only, as the admin).
admin.site.site_url = reverse_lazy("dashboard:fleet")

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="dashboard:fleet"), name="home"),
    path("admin/", admin.site.urls),
    path("dashboard/", include("dashboard.urls")),
    path("", include("registry.api.urls")),
    path("metrics", metrics_view, name="metrics"),
]
