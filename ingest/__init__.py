"""Ingest: the write path. The engines' KV events over ZeroMQ into the index.

``events`` decodes the wire formats; ``pool`` shards messages over workers by pod; ``applier``
turns events into index writes; ``resync`` and ``replay`` keep each engine's stream whole;
``pipeline`` wires them (``processes`` for ``--processes N``, ``curve`` for CURVE on the
sockets); ``membership`` shares the pods between ingest replicas; ``stats`` and ``history`` count
and record what came in. ``service`` is one process's write path as the settings say (the
pipeline, the membership, the pod liveness prober of ``registry.liveness`` and the housekeeping
that needs Django); ``manage.py ingest`` is the command that runs it over the shared index.

May import: ``registry``, ``kvindex``; never ``scoring``, ``gateway`` or ``dashboard``
(``make lint``'s contracts).
"""
