"""WSGI entry point (for WSGI servers; the project itself runs as ASGI: `manage.py serve`)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvsite.settings")
application = get_wsgi_application()
