"""Routes of the registry API (``kvsite.urls`` includes them beside the schema and its docs)."""

from __future__ import annotations

from django.urls import path, re_path

from registry.api import views

urlpatterns = [
    path("api/v1/pods/", views.PodListView.as_view(), name="pods"),
    path("api/v1/pods/<str:pod_id>/", views.PodDetailView.as_view(), name="pod"),
    path("api/v1/models/", views.ModelConfigListView.as_view(), name="model-configs"),
    # Model names contain "/" (e.g. "Qwen/Qwen3-0.6B"): the name is everything up to the last "/".
    re_path(r"^api/v1/models/(?P<name>.+)/$", views.ModelConfigDetailView.as_view(), name="model-config"),
    path("api/v1/hash-seed/", views.HashSeedView.as_view(), name="hash-seed"),
]
