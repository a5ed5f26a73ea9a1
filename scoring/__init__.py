"""Scoring: the read path. For a prompt, how many leading blocks of it each pod holds.

* ``read_path``: a request (prompt, chat or token ids) to block keys to the index's holders to
  per-pod scores;
* ``scorer``: the longest-prefix score over the holders of a run of keys;
* ``fastpath/``: the scoring API, a plain ASGI app outside Django's request cycle (``app``), its
  request schema, error table and metrics, and its pages in the OpenAPI schema (``openapi``);
* ``wiring``: the fast path wired to this process's settings and handles (Django's side).

May import: ``registry``, ``kvindex``, ``tokenization``, ``stack`` (``stack.trust``: the API keys);
never ``ingest``, ``gateway`` or ``dashboard`` (``make lint``'s contracts).
"""
