"""The HTTP API: scoring (upstream-compatible and ours), the registry for staff, schema, probes.

Thin Django/DRF shells: validation and shaping in ``serializers``, the read path in
``scoring.read_path``, writes in ``registry.services``, error mapping in ``errors``.
"""
