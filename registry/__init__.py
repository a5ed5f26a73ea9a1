"""The registry: the Django app of pods, model configs and the hash seed, and what the rest of
the system knows of them.

* ``models``, ``migrations``, ``admin``: the tables and their admin (app label ``scoring``, kept
  from before this package had its own name, so that existing databases, permissions and admin
  URLs stay as they were);
* ``services`` (writes, with their effects on the index) and ``selectors`` (reads);
* ``api/``: the registry over HTTP for staff, and the DRF API's error shape and authentication;
* ``config``: ``ServiceConfig``, the registry as plain immutable values (no Django), and
  ``snapshot``, the refreshed copy each process scores with;
* ``liveness``: the pod liveness prober that ``ingest`` runs (no Django);
* ``runtime``: this process's handles, built from the settings: the registry snapshot, the index,
  the tokenizers, the template sandbox.

May import: ``kvindex``, ``tokenization``, ``stack`` (``stack.trust``: the trusted proxies) and
Django; nothing above it (``make lint``'s contracts).
"""
