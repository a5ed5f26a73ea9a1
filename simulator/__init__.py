"""The simulator: simulated vLLM pods (``manage.py simulate``) that serve the OpenAI API, publish
KV events as vLLM does and expose vLLM's metrics; and the load generator (``loadgen/``,
``manage.py loadgen``) that drives a fleet through a router and reports.

May import: ``ingest`` (the event wire format and the replay protocol), ``registry`` (to register
its pods), ``tokenization``, ``kvindex``; never ``scoring``, ``gateway`` or ``dashboard`` (``make
lint``'s contracts).
"""
