"""The scoring API as a plain ASGI application, outside Django's request cycle: ``app`` (routing,
authentication, bounded work), ``schema`` (request validation with msgspec), ``errors`` (what the
core's exceptions are answered with), ``metrics`` and ``openapi`` (its pages in the schema)."""
