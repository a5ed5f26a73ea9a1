"""A KV-aware OpenAI gateway: ``/v1/completions`` and ``/v1/chat/completions`` go to the pod that
holds the most of the request's prefix, weighed against its load.

The core (``app``: the ASGI proxy that carries the request to the pod ``routing`` chose) imports
no Django; ``asgi`` and the ``gateway`` command are the Django shell that hands it the registry
snapshot, the index, the tokenizers and the settings.

May import: ``routing`` (the routing core it shares with the EPP), ``scoring`` (the read path),
``registry``, ``kvindex``, ``tokenization``, ``stack`` (the uvicorn runner); never ``ingest`` or
``dashboard`` (``make lint``'s contracts).
"""
