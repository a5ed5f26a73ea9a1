"""What operators and tooling see: the OpenAPI schema and its docs (served locally), the health
probes, and the Prometheus metrics with upstream's names."""

from __future__ import annotations

import re
import time

import pytest
import redis
import yaml
from asgiref.sync import async_to_sync
from django.test import Client

from kvindex import open_index
from kvindex.epochs import READY, RESYNCING, marker
from kvindex.shared_stats import publish_snapshot
from registry import runtime
from registry.models import Pod
from registry.runtime import invalidate_service_config
from tests.api.conftest import MODEL, post
from tests.servers import free_port


def test_the_openapi_schema_describes_every_endpoint(client):
    response = client.get("/api/schema/")
    assert response.status_code == 200
    schema = yaml.safe_load(response.content)
    assert schema["openapi"].startswith("3.")
    assert {
        "/score_completions",
        "/score_chat_completions",
        "/api/v1/score",
        "/api/v1/pods/",
        "/api/v1/pods/{pod_id}/",
        "/api/v1/models/",
        "/api/v1/models/{name}/",
        "/api/v1/hash-seed/",
    } <= set(schema["paths"])
    score = schema["components"]["schemas"]["ScoreRequest"]
    assert {"model", "prompt", "messages", "token_ids", "pods", "lora_name"} <= set(score["properties"])


def test_the_interactive_docs_load_their_assets_from_this_server(client):
    page = client.get("/api/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    # No asset from another host (the page also holds random tokens: match URLs, not letters).
    assert not re.search(r"(?:src|href|url)\s*[=:(]\s*[\"']?(?:https?:)?//", html, re.IGNORECASE)
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
    for asset in assets:
        response = client.get(asset)
        assert response.status_code == 200, asset
        assert response.content


def test_the_redoc_page_loads_nothing_from_another_host(client):
    page = client.get("/api/redoc/")
    assert page.status_code == 200
    html = page.content.decode()
    assert not re.search(r"https?://", html)  # no font, no script, no style from elsewhere
    # nor may ReDoc's script fetch anything from elsewhere (it shows a logo from its CDN)
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html)
    assert policy and policy[1] == "default-src 'self' 'unsafe-inline' 'unsafe-eval' blob: data:"
    assets = re.findall(r'src="(/static/[^"]+)"', html)
    assert any(a.endswith("redoc.standalone.js") for a in assets)
    for asset in assets:
        response = client.get(asset)
        assert response.status_code == 200, asset
        assert response.content


def test_healthz_says_the_process_is_alive(client):
    response = client.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


POD_IP = "10.1.2.3:8000"  # the Host header of a Kubernetes probe, not in ALLOWED_HOSTS


def test_the_probes_answer_whatever_the_host_header_and_the_rest_checks_it(client, index):
    """Through the ASGI application ``manage.py serve`` runs (``/healthz`` on the fast path)."""
    assert client.get("/healthz", HTTP_HOST=POD_IP).json() == {"status": "ok"}
    ready = client.get("/readyz", HTTP_HOST=POD_IP)
    assert (ready.status_code, ready.json()["status"]) == (200, "ready")
    assert client.get("/metrics", HTTP_HOST=POD_IP).status_code == 200  # Prometheus by pod IP
    assert client.get("/api/schema/", HTTP_HOST=POD_IP).status_code == 400


def test_the_probes_answer_whatever_the_host_header_through_django_alone(index):
    """Through Django's own handler, as ``kvsite.wsgi`` serves it (no fast path)."""
    django_client = Client()
    response = django_client.get("/healthz", HTTP_HOST=POD_IP)
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert django_client.get("/readyz", HTTP_HOST=POD_IP).status_code == 200
    assert django_client.get("/metrics", HTTP_HOST=POD_IP).status_code == 200
    assert django_client.get("/api/schema/", HTTP_HOST=POD_IP).status_code == 400


def test_readyz_checks_the_index_and_the_database(client, index):
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "checks": {"index": "ok", "database": "ok"}}


@pytest.mark.django_db
def test_readyz_says_index_resyncing_while_ingest_rebuilds_a_lost_index(client, index):
    Pod.objects.create(pod_id="pod-a", model=MODEL)
    invalidate_service_config()
    index.set_epoch(model=MODEL, value=marker("t1", READY))
    assert client.get("/readyz").status_code == 200  # this process has seen the marker now

    index.set_epoch(model=MODEL, value=marker("t2", RESYNCING))  # ingest noticed a loss
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["checks"]["index"] == f"index resyncing: {MODEL}"
    assert sample(metrics_text(client), "kvcache_index_resyncing", model=MODEL) == 1

    index.set_epoch(model=MODEL, value=marker("t2", READY))
    assert client.get("/readyz").status_code == 200
    assert sample(metrics_text(client), "kvcache_index_resyncing", model=MODEL) == 0


@pytest.mark.django_db
def test_readyz_says_index_resyncing_when_a_seen_marker_vanished(client, redis_url, settings):
    settings.REDIS_URL = redis_url
    idx = open_index(redis_url)
    runtime.set_index(idx)
    try:
        Pod.objects.create(pod_id="pod-a", model=MODEL)
        invalidate_service_config()
        idx.set_epoch(model=MODEL, value=marker("t1", READY))
        assert client.get("/readyz").status_code == 200
        redis.Redis.from_url(redis_url).flushall()  # restarted empty; ingest has not noticed yet
        response = client.get("/readyz")
        assert response.status_code == 503
        assert "index resyncing" in response.json()["error"]["message"]
    finally:
        runtime.set_index(None)
        idx.close()


def metrics_text(client) -> str:
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.content.decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of the exposition ``text`` (None when absent)."""
    for line in text.splitlines():
        metric, _, value = line.rpartition(" ")
        found_name, _, found_labels = metric.partition("{")
        if found_name != name:
            continue
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', found_labels))
        if all(pairs.get(k) == v for k, v in labels.items()):
            return float(value)
    return None


def test_metrics_count_lookups_tokenization_and_requests_under_upstream_names(client, engines, base_capture):
    engines.cache_capture("pod-a", base_capture)
    before = metrics_text(client)
    post(client, "/score_completions", {"model": MODEL, "prompt": base_capture["prompt"]})
    post(client, "/score_chat_completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    post(client, "/score_completions", {"model": "nobody/unknown", "prompt": "hello"})
    after = metrics_text(client)

    def grew(name: str, **labels: str) -> float:
        return (sample(after, name, **labels) or 0.0) - (sample(before, name, **labels) or 0.0)

    assert grew("kvcache_index_lookup_requests_total") == 1  # the chat prompt is under one block
    assert grew("kvcache_index_lookup_hits_total") == 25
    assert grew("kvcache_index_lookup_latency_seconds_count") == 1
    assert grew("kvcache_tokenization_tokenization_latency_seconds_count", tokenizer=MODEL) == 2
    assert grew("kvcache_tokenization_tokenized_tokens_total", tokenizer=MODEL) >= 402
    assert grew("kvcache_tokenization_render_chat_template_latency_seconds_count", tokenizer=MODEL) == 1
    assert grew("kvcache_scoring_requests_total", endpoint="score_completions", outcome="ok") == 1
    assert (
        grew("kvcache_scoring_requests_total", endpoint="score_completions", outcome="model_not_found") == 1
    )
    assert grew("kvcache_tokenization_prefix_store_requests_total", tokenizer=MODEL) == 2
    assert grew("kvcache_scoring_hits_total", endpoint="score_completions") == 1  # pod-a held the prompt
    assert grew("kvcache_scoring_hits_total", endpoint="score_chat_completions") == 0
    assert sample(after, "kvcache_pod_blocks", pod="pod-a", model=MODEL, tier="gpu") == 25
    assert sample(after, "kvcache_index_up") == 1


@pytest.mark.parametrize("index", ["redis"], indirect=True)
def test_metrics_include_the_ingest_processes_counters(client, index, redis_url):
    stream = {
        "pod": "pod-a",
        "rank": 0,
        "model": MODEL,
        "batches": 3,
        "events": 5,
        "blocks_stored": 40,
        "blocks_removed": 2,
        "clears": 0,
        "ignored_batches": 0,
        "orphaned_blocks": 1,
        "aligned_blocks": 40,
        "misaligned_blocks": 0,
        "seq_gaps": 0,
        "missed_batches": 0,
        "restarts": 0,
        "decode_errors": {"bad_payload": 1},
        "last_seq": 2,
        "first_event_at": time.time() - 5,
        "last_event_at": time.time(),
        "lag_seconds": 0.01,
        "hash_alignment": 1.0,
    }
    client_redis = redis.Redis.from_url(redis_url)
    for instance in ("ingest-1", "ingest-2"):  # two processes that both heard from pod-a
        snapshot = {"at": time.time(), "streams": [stream], "unattributed_errors": {"bad_topic": 2}}
        publish_snapshot(client_redis, {**snapshot, "queue_full": {"0": 1}}, instance=instance)

    text = metrics_text(client)
    labels = {"pod": "pod-a", "rank": "0", "model": MODEL}
    assert sample(text, "kvcache_index_admissions_total", **labels) == 80
    assert sample(text, "kvcache_index_evictions_total", **labels) == 4
    assert sample(text, "kvcache_ingest_decode_errors_total", reason="bad_payload", **labels) == 2
    assert sample(text, "kvcache_ingest_decode_errors_total", reason="bad_topic") == 4
    assert sample(text, "kvcache_ingest_queue_full_total", worker="0") == 2
    assert sample(text, "kvcache_ingest_stats_up") == 1


def test_metrics_say_when_the_ingest_stats_cannot_be_read(client, index, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    assert sample(metrics_text(client), "kvcache_ingest_stats_up") == 0


def test_start_up_loads_the_registrys_tokenizers_before_any_request(db):
    from kvsite.asgi import application
    from registry import runtime
    from registry.models import Pod

    Pod.objects.create(pod_id="pod-a", model=MODEL)
    Pod.objects.create(pod_id="pod-b", model="nobody/unknown-model")
    runtime.invalidate_service_config()
    runtime.set_tokenizers(runtime.build_tokenizers())
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message["type"])

    async_to_sync(application)({"type": "lifespan"}, receive, send)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert runtime.get_tokenizers().cached_models() == [MODEL]  # the unknown one is skipped
