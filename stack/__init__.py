"""``python -m stack``: run the Procfile's processes together, as honcho does, and stop them in
their declared order (``make run`` uses it). Django-free.

``stack.procfile`` reads the Procfile, with its shutdown order and essential processes;
``stack.supervisor`` runs them. ``stack.asgi_server`` runs an ASGI application under uvicorn
workers: the web (``manage.py serve``) and the gateway (``manage.py gateway``) both serve that way,
with the same limits on every connection (``ConnectionLimits``). ``stack.trust`` says whom they
trust: API keys and reverse proxies.

May import: nothing of this project's (``make lint``'s contracts).
"""
