"""The site: the Django project that wires every box together.

``settings`` (every setting, from the environment), ``urls``, ``asgi`` (the fast path, Django and
the websockets in one application), ``manage.py serve`` (``management/commands/serve.py``), and
the site's own pieces: the health probes (``probes``), ``/metrics`` (``metrics``), middleware, and
the DRF API's parser and exception handler (``drf``).

May import: everything below it; nothing imports it (``make lint``'s contracts).
"""
