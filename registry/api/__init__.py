"""The registry over HTTP, for staff: pods, model configs, the hash seed (``/api/v1/pods/``,
``/api/v1/models/``, ``/api/v1/hash-seed/``).

Thin DRF shells: validation and shaping in ``serializers``, writes in ``registry.services``,
reads in ``registry.selectors``; ``auth`` has the staff logins (throttled) and ``errors`` the API's
one error shape. The site's DRF plumbing (body parser, exception handler) is ``kvsite.drf``.
"""
