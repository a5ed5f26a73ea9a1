"""Websocket routes of the dashboard (mounted by ``kvsite.asgi``)."""

from django.urls import path

from dashboard.consumers import DashboardConsumer

websocket_urlpatterns = [
    path("ws/dashboard/", DashboardConsumer.as_asgi()),
    path("ws/dashboard/pods/<path:pod>/", DashboardConsumer.as_asgi()),
]
