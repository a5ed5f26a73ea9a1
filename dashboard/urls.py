"""Dashboard pages (mounted at ``/dashboard/``)."""

from django.urls import path

from dashboard import views

app_name = "dashboard"
urlpatterns = [
    path("", views.fleet, name="fleet"),
    path("pods/<path:pod>/", views.pod_detail, name="pod"),
]
