"""ASGI entry point (daphne): HTTP through Django, websockets through Channels."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvsite.settings")
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402  (needs the app registry ready)

application = ProtocolTypeRouter({"http": django_asgi_app})
