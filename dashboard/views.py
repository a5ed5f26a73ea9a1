"""Dashboard pages: thin shells; the numbers arrive over the websocket (``consumers``)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.admin.views.decorators import staff_member_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from registry.models import Pod


def _live_settings() -> dict:
    """What the page's script needs to know about the stream it will get."""
    return {
        "push_seconds": settings.DASHBOARD_PUSH_SECONDS,
        "history_seconds": settings.DASHBOARD_HISTORY_SECONDS,
    }


@staff_member_required
def fleet(request: HttpRequest) -> HttpResponse:
    """One row per pod, fleet totals and charts, updated live."""
    return render(request, "dashboard/fleet.html", _live_settings())


@staff_member_required
def pod_detail(request: HttpRequest, pod: str) -> HttpResponse:
    """One pod: its numbers, history and recent activity. A pod the registry does not know may
    still be in the index or an ingest stream, so an unknown id is not a 404."""
    return render(
        request,
        "dashboard/pod.html",
        {"pod": pod, "registered": Pod.objects.filter(pod_id=pod).first(), **_live_settings()},
    )
