"""The Endpoint Picker (EPP) of the Gateway API Inference Extension: Envoy (a Gateway's, or ours in
``make run FRONT=envoy``) asks it over ext_proc gRPC where each request goes, and it answers with
the routing core's choice (``routing``), the gateway's own: Envoy carries the bytes, we decide.

The core (``server``: the ext_proc protocol; ``service``: the gRPC server, health, metrics, the
endpoints file; ``envoy``: deploy/envoy's configuration and binary; ``metrics``) imports no
Django; the ``epp`` command is the Django shell that hands it the registry snapshot, the index,
the tokenizers and the settings.

May import: ``routing``, ``scoring``, ``registry``, ``kvindex``, ``tokenization``, ``stack``; never
``ingest``, ``dashboard`` or ``gateway`` (``make lint``'s contracts).
"""
