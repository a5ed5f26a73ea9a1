"""ASGI entry point (daphne): HTTP through Django, websockets through Channels.

Websockets carry the session (``AuthMiddlewareStack``: consumers check the user themselves) and
must come from one of ``ALLOWED_HOSTS`` (``AllowedHostsOriginValidator``: no cross-site pages).
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvsite.settings")
django_asgi_app = get_asgi_application()

# These need the app registry ready.
from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from dashboard.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
