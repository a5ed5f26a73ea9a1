"""Load generator for routing benchmarks: an OpenAI workload sent to a (simulated) vLLM fleet,
each request routed by a pluggable router, with latency and prefix-cache hit-rate reports.

Pure core, no Django: ``workload`` (deterministic requests), ``routers`` (pod choice),
``client`` (SSE streaming, scores, pod metrics over HTTP), ``runner`` (Poisson arrivals, one run
per router and QPS), ``report`` (percentiles, tables, JSON). ``manage.py loadgen`` and
``bench/routing.py`` are thin shells around :func:`simulator.loadgen.runner.run_ladder`.
"""
