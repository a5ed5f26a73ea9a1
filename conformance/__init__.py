"""Conformance with vLLM 0.33: vLLM's own KV-cache manager and event publisher against our ingest and
scoring. Runs in its own venv (``make conformance``); see README.md, "Conformance with vLLM 0.33"."""
