"""Ingest: the write path. The engines' KV events over ZeroMQ into the index.

``events`` decodes the wire formats; ``pool`` shards messages over workers by pod; ``applier``
turns events into index writes; ``resync`` and ``replay`` keep each engine's stream whole;
``pipeline`` wires them (``processes`` for ``--processes N``, ``curve`` for CURVE on the
sockets); ``membership`` shares the pods between ingest replicas; ``stats`` and ``history`` count
and record what came in. ``manage.py ingest`` is the command, and runs the pod liveness prober
(``registry.liveness``) too.

May import: ``registry``, ``kvindex``; never ``scoring``, ``gateway`` or ``dashboard``
(``make lint``'s contracts).
"""
