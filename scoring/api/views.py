"""The readiness probe (``/healthz`` and the scoring endpoints are served by the fast path,
``scoring.fastpath.app``; their documentation is added to the schema by ``scoring.api.openapi``)."""

from __future__ import annotations

from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse

from scoring import runtime
from scoring.api.errors import error_body
from scoring.index import IndexUnavailable


def readyz(request: HttpRequest) -> JsonResponse:
    """Ready when the index and the database both answer and the index holds its data: 503
    (error shape, plus ``checks``) naming what does not, e.g. ``index resyncing`` while ingest
    rebuilds what the index lost (``scoring.epochs``)."""
    checks: dict[str, str] = {}
    try:
        runtime.get_index().ping()
        resyncing = runtime.resyncing_models()
        checks["index"] = f"index resyncing: {', '.join(resyncing)}" if resyncing else "ok"
    except IndexUnavailable as error:
        checks["index"] = str(error)
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        checks["database"] = "ok"
    except DatabaseError as error:
        checks["database"] = f"the database cannot be reached: {error}"
    failing = {name: problem for name, problem in checks.items() if problem != "ok"}
    if not failing:
        return JsonResponse({"status": "ready", "checks": checks})
    message = "; ".join(f"{name}: {problem}" for name, problem in failing.items())
    return JsonResponse({**error_body("not_ready", message), "checks": checks}, status=503)
