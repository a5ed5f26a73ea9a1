"""ASGI entry point (``manage.py serve``, uvicorn): the scoring fast path, Django, Channels.

* HTTP to the scoring endpoints and ``/healthz`` goes to the fast path
  (``scoring.fastpath.app``), without Django's request cycle (nor its Host header check), and so
  do the reads of the KV-indexer API (``/kv-indexer/query``, ``query_by_hash``, ``workers``,
  ``dump``: ``scoring.fastpath.kv_indexer``; its registry writes are Django's);
* every other HTTP request goes to Django (admin, registry API, dashboard, docs, metrics, and
  ``/readyz``, which like ``/healthz`` answers whatever the Host: ``kvsite.middleware``);
* websockets go to Channels: they carry the session (``AuthMiddlewareStack``: consumers check
  the user themselves) and must come from one of ``ALLOWED_HOSTS``
  (``AllowedHostsOriginValidator``: no cross-site pages);
* lifespan: at start-up the registry snapshot is loaded and its models' tokenizers too (so no
  first request waits for either), the start-up heap is frozen out of the garbage collector's
  reach, and a ``manage.py serve`` process starts sharing its scoring traffic for the
  dashboard's history (``dashboard.traffic``); at shutdown the fast path's threads and template
  sandbox stop. With ``serve --index in-process`` the worker first opens its own index and starts
  the ingest that fills it (``ingest.in_process``), its counters on ``/metrics``.
"""

import logging
import os
import sys

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvsite.settings")
django_asgi_app = get_asgi_application()

# These need the app registry ready.
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402

from dashboard import traffic  # noqa: E402
from dashboard.routing import websocket_urlpatterns  # noqa: E402
from ingest.in_process import IngestSetupError, InProcessIndex  # noqa: E402
from registry import runtime  # noqa: E402
from scoring.fastpath.kv_indexer import KVIndexerApp  # noqa: E402
from scoring.wiring import build_scoring_app  # noqa: E402

in_process = InProcessIndex.from_environment()
scoring_app = build_scoring_app()
kv_indexer_app = KVIndexerApp(scoring_app)
FAST_PATHS = frozenset(scoring_app.PATHS)
KV_INDEXER_PATHS = frozenset(kv_indexer_app.PATHS)

websockets = AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns)))
protocols = ProtocolTypeRouter({"http": django_asgi_app, "websocket": websockets})


async def application(scope, receive, send):
    """Routes each connection (see the module docstring)."""
    kind = scope["type"]
    if kind == "http" and scope["path"] in FAST_PATHS:
        await scoring_app(scope, receive, send)
    elif kind == "http" and scope["path"] in KV_INDEXER_PATHS:
        await kv_indexer_app(scope, receive, send)
    elif kind == "lifespan":
        await lifespan(receive, send)
    else:
        await protocols(scope, receive, send)


async def lifespan(receive, send):
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            if in_process is not None:
                try:
                    logging.getLogger("serve").info("%s", await in_process.astart(REGISTRY))
                except IngestSetupError as error:
                    await send({"type": "lifespan.startup.failed", "message": str(error)})
                    return
            await runtime.warm_up()
            # A thread doing Python work (keys of a long prompt, a prefix store update) gives the
            # event loop the GIL back within 1 ms, not 5: small requests wait less behind it.
            sys.setswitchinterval(0.001)
            traffic.start_publishing()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            scoring_app.close()
            runtime.close_sandbox()
            runtime.close_large_prompts()
            if in_process is not None:
                await in_process.astop()
            await send({"type": "lifespan.shutdown.complete"})
            return
