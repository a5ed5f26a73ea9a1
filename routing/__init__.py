"""The routing core: which pod an OpenAI request should go to, for whichever front carries it
(the gateway, ``gateway/``, which then forwards the request; the Endpoint Picker, ``epp/``, which
names the pod to Envoy).

``router`` (the choice: parse, live pods, tokenize once, the index and speculative entries, load,
the policy), ``policies``, ``memory`` (speculative entries, the approximate prefix tree), ``load``
(the pods' load and service times, their ``/metrics`` scraped), ``upstream`` (the HTTP/1.1 client
for the pods) and ``metrics`` (what the core counts, under its front's name). No Django.

May import: ``scoring`` (the read path), ``registry`` (its plain values: ``config``,
``pod_metrics``), ``kvindex``, ``tokenization``, ``stack``; never ``ingest``, ``gateway``,
``epp`` or ``dashboard`` (``make lint``'s contracts).
"""
