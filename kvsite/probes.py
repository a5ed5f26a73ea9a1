"""The health probes, answered whatever the Host header (``kvsite.middleware.ProbesAndScrapes``).
Under ``manage.py serve`` the fast path (``scoring.fastpath.app``) answers ``/healthz`` and the
scoring endpoints; their documentation is added to the schema by ``scoring.fastpath.openapi``."""

from __future__ import annotations

import logging

from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse

from kvindex import IndexUnavailable
from registry import runtime
from registry.api.errors import error_body

logger = logging.getLogger(__name__)


def healthz(request: HttpRequest) -> JsonResponse:
    """Alive: the process answers. Under ``kvsite.asgi`` the fast path answers ``/healthz``; this
    is the same for Django served alone (``kvsite.wsgi``)."""
    return JsonResponse({"status": "ok"})


def readyz(request: HttpRequest) -> JsonResponse:
    """Ready when the index and the database both answer and the index holds its data: 503
    (error shape, plus ``checks``) naming what does not, e.g. ``index resyncing`` while ingest
    rebuilds what the index lost (``kvindex.epochs``). An unreachable one is named, not its
    address: the error, which says host and port, goes to the log."""
    checks: dict[str, str] = {}
    try:
        runtime.get_index().ping()
        resyncing = runtime.resyncing_models()
        checks["index"] = f"index resyncing: {', '.join(resyncing)}" if resyncing else "ok"
    except IndexUnavailable as error:
        logger.warning("not ready: %s", error)
        checks["index"] = "index unreachable"
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except DatabaseError as error:
        logger.warning("not ready: the database cannot be reached: %s", error)
        checks["database"] = "database unreachable"
    failing = {name: problem for name, problem in checks.items() if problem != "ok"}
    if not failing:
        return JsonResponse({"status": "ready", "checks": checks})
    message = "; ".join(f"{name}: {problem}" for name, problem in failing.items())
    return JsonResponse({**error_body("not_ready", message), "checks": checks}, status=503)
