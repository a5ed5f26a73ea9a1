"""The site's middleware: probes and scrapes before the Host check, and a synchronous chain."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

from kvsite import probes
from kvsite.metrics import metrics_view


class SyncMiddlewareChain:
    """Keeps Django's middleware chain synchronous under ASGI (uvicorn); it does nothing else.

    Under ASGI, Django runs a middleware in async mode when it and everything inside it can, and
    an async-mode ``MiddlewareMixin`` middleware (all of Django's own) hops to a thread and back
    for each of its ``process_*`` methods: about 20 thread hops per request here, ~1.1 ms of the
    scoring endpoints' latency. Being sync-only and innermost (last in ``MIDDLEWARE``), this one
    makes every middleware run in sync mode, in the one thread that also runs the (sync) views:
    three hops in all. Async views still work; they pay one more hop.
    """

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)


class ProbesAndScrapes:
    """Answers the health probes (``/healthz``, ``/readyz``) and the Prometheus scrape
    (``/metrics``) whatever the Host header says.

    Kubernetes probes and Prometheus's pod discovery send the pod's IP as Host, which
    ``ALLOWED_HOSTS`` does not list; these views build no URL from it, so checking it could only
    fail them. Every other request still meets the check (in ``CommonMiddleware``, after this one).
    """

    PROBES = {"/healthz": probes.healthz, "/readyz": probes.readyz, "/metrics": metrics_view}

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        probe = self.PROBES.get(request.path_info)
        return probe(request) if probe is not None else self.get_response(request)
