"""The live dashboard: the fleet, its pods and the gateways, pushed over a websocket to staff.

``fleet`` and ``gateways`` are pure functions over plain values; ``selectors`` reads the rest of
the system (registry, index, shared stats, the gateways' metrics); ``sampler`` keeps this
process's running picture; ``consumers``, ``views`` and ``traffic`` are the Django shells.

May import: ``registry``, ``kvindex`` (and ``scoring``, below it); never ``ingest``, ``gateway``
or ``simulator`` (``make lint``'s contracts).
"""
