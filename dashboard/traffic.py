"""The scoring traffic the charts show, shared through Redis for the history ingest records.

The charts' scoring requests per second and hit rate count the requests the web's score API served
and those the gateways in ``KVCACHE_GATEWAY_URLS`` routed (``selectors.routing_counters``). Ingest
records the charts' history (``ingest.history``) but sees neither, so every web process of
``manage.py serve`` runs one daemon thread that, once a second, publishes into Redis
(``kvindex.shared_stats.publish_scoring``) its own cumulative counters under ``web:<host>:<pid>``,
and each gateway's (one scrape of its ``/metrics``) under ``gateway:<url>``: web processes write a
gateway's counters over each other's, never beside them, so no request is counted twice.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

import redis
from django.conf import settings
from prometheus_client import REGISTRY, CollectorRegistry

from dashboard import selectors
from dashboard.gateways import GatewayScrape, gateway_traffic
from kvindex.shared_stats import instance_id, publish_scoring
from registry.runtime import index_is_shared

log = logging.getLogger(__name__)

PUBLISH_SECONDS = 1.0


def publish_once(
    client: redis.Redis, *, registry: CollectorRegistry = REGISTRY, gateways: list[GatewayScrape]
) -> list[str]:
    """Publish this process's scoring counters (read from ``registry``; none before the score API
    registered them) and those of every gateway that answered ``gateways``' scrapes; returns
    the sources published. Its own, not every worker's (``selectors.all_workers_metrics``, what the
    totals read): each worker publishes its own and the history sums the sources."""
    published = []
    own = selectors.scoring_counters(registry)
    if own is not None:
        source = f"web:{instance_id()}"
        publish_scoring(client, source=source, at=time.time(), requests=own.requests, hits=own.hits)
        published.append(source)
    for scrape in gateways:
        routed = gateway_traffic([scrape])
        if routed is not None:
            source = f"gateway:{scrape.url}"
            publish_scoring(client, source=source, at=scrape.at, requests=routed.requests, hits=routed.hits)
            published.append(source)
    return published


def _publish_forever() -> None:
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2.0)
    failing = False
    while True:
        try:
            publish_once(client, gateways=selectors.scrape_gateways())
            failing = False
        except redis.RedisError as e:
            if not failing:  # once per outage, not once a second
                log.warning("could not publish the scoring counters to Redis: %s", e)
            failing = True
        except Exception:
            log.exception("publishing the scoring counters failed")
        time.sleep(PUBLISH_SECONDS)


_started = False
_start_lock = threading.Lock()


def start_publishing() -> None:
    """Start this process's publisher, once, if it is a ``manage.py serve`` process (its workers
    run with the same arguments) and the index is shared through Redis."""
    global _started
    if sys.argv[1:2] != ["serve"] or not index_is_shared():
        return
    with _start_lock:
        if not _started:
            threading.Thread(target=_publish_forever, name="scoring-traffic", daemon=True).start()
            _started = True
