"""The dashboard websocket through the real ASGI stack: who may connect, what it sends, that what
a real ingest pipeline applies reaches it through the channel layer, and that its charts are the
history ingest recorded in Redis, whoever looks and whenever."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from dashboard import sampler as sampler_module
from dashboard.sampler import FleetSampler
from ingest.events import BlockRemoved
from ingest.service import Housekeeping
from kvindex import open_index
from registry.models import Pod
from registry.runtime import set_index
from tests.dashboard.conftest import communicator, receive_until, session_cookie, unreachable_url
from tests.events import stored_event
from tests.ingest.conftest import MODEL, ingest_housekeeping

ROW_FIELDS = {
    "pod",
    "model",
    "blocks_by_tier",
    "blocks",
    "stored_per_s",
    "removed_per_s",
    "events_per_s",
    "last_event_age",
    "seq_gaps",
    "missed_batches",
    "restarts",
    "replayed_batches",
    "lost_state_clears",
    "resyncing",
    "decode_errors",
    "hash_alignment",
    "ranks",
    "health",
    "status",
}
TOTALS_FIELDS = {
    "pods",
    "active",
    "idle",
    "stale",
    "down",
    "disabled",
    "blocks",
    "blocks_by_tier",
    "stored_per_s",
    "removed_per_s",
    "events_per_s",
    "seq_gaps",
    "decode_errors",
    "ingest_processes",
    "scoring_available",
    "hit_rate_available",
    "score_requests_per_s",
    "hit_rate",
    "index_available",
    "index_resyncing",
}


@pytest.fixture
def memory_index():
    idx = open_index("memory://")
    set_index(idx)
    yield idx
    set_index(None)
    idx.close()


@pytest.mark.parametrize("who", ["anonymous", "plain_user"])
def test_only_staff_may_connect(who, request, transactional_db):
    cookie = session_cookie(request.getfixturevalue(who)) if who != "anonymous" else ""

    async def attempt():
        comm = communicator("/ws/dashboard/", cookie=cookie)
        connected, _ = await comm.connect()
        await comm.disconnect()
        return connected

    assert async_to_sync(attempt)() is False


def test_a_page_of_another_site_may_not_connect(staff_user):
    cookie = session_cookie(staff_user)

    async def attempt():
        comm = communicator("/ws/dashboard/", cookie=cookie, origin="https://evil.test")
        connected, _ = await comm.connect()
        await comm.disconnect()
        return connected

    assert async_to_sync(attempt)() is False


def test_staff_get_history_then_frames(staff_user, memory_index):
    cookie = session_cookie(staff_user)

    async def scenario():
        comm = communicator("/ws/dashboard/", cookie=cookie)
        connected, _ = await comm.connect()
        assert connected
        history = await comm.receive_json_from(timeout=5)
        frames = [await comm.receive_json_from(timeout=5) for _ in range(2)]
        await comm.disconnect()
        return history, frames

    history, frames = async_to_sync(scenario)()
    assert history["type"] == "history"
    assert {"t", "blocks", "events_per_s", "score_requests_per_s", "hit_rate", "pods"} <= set(history)
    assert [f["type"] for f in frames] == ["frame", "frame"]
    assert frames[1]["at"] > frames[0]["at"]  # pushed again, not the same frame twice
    assert set(frames[0]["totals"]) == TOTALS_FIELDS
    assert frames[0]["pods"] == []
    assert frames[0]["gateways"] == []  # none configured


def test_the_fleet_frame_carries_the_gateways(staff_user, memory_index, settings, gateway_metrics):
    refused = unreachable_url()
    settings.KVCACHE_GATEWAY_URLS = [gateway_metrics.url, refused]
    counted = gateway_metrics.metrics
    counted.REQUESTS.labels("kv-load", "sim-0", "ok").inc(3)
    counted.HITS.labels("kv-load").inc(3)
    for _ in range(3):
        counted.TTFT.labels("kv-load").observe(0.03)
    cookie = session_cookie(staff_user)

    async def scenario():
        comm = communicator("/ws/dashboard/", cookie=cookie)
        assert (await comm.connect())[0]
        await comm.receive_json_from(timeout=5)  # history
        # from the second scrape on there is a window, hence recent numbers
        frame = await receive_until(
            comm, lambda m: m["type"] == "frame" and m["gateways"][0]["window_seconds"]
        )
        await comm.disconnect()
        return frame

    up, down = async_to_sync(scenario)()["gateways"]
    assert (up["url"], up["reachable"], up["policy"]) == (gateway_metrics.url, True, "kv-load")
    assert (up["requests"], up["requests_per_s"], up["hit_rate_overall"]) == (3, 0.0, 1.0)
    assert up["ttft_p50_overall"] == pytest.approx(0.025 + 0.025 * 1.5 / 3)
    assert up["ttft_p50"] is None  # nothing observed in the window
    assert up["pods"] == [
        {
            "pod": "sim-0",
            "requests": 3,
            "not_ok": 0,
            "share": 1.0,
            "requests_per_s": 0.0,
            "prefills": None,
            "prefills_per_s": None,
            "prefills_not_ok": None,
        }
    ]
    assert up["pd"] is None  # no prefill/decode disaggregation
    assert (down["url"], down["reachable"], down["policy"], down["requests"]) == (refused, False, None, None)


@pytest.fixture
def pipeline(settings, redis_url):
    """A real ingest pipeline writing to the Redis index the web side reads, and the ingest
    command's housekeeping for it (registry, Redis snapshot, channel-layer group)."""
    settings.REDIS_URL = redis_url
    settings.KVCACHE_INDEX_BACKEND = "redis"
    # Only the group may bring snapshots here: Redis (the fallback) is never read.
    sampler_module._sampler = FleetSampler(min_interval=0.05, stale_after=60, group_silence=float("inf"))
    with ingest_housekeeping(redis_url) as running:
        yield running


def test_frames_follow_events_through_a_real_pipeline(staff_user, pipeline, base_capture):
    harness, housekeeping = pipeline
    cookie = session_cookie(staff_user)

    def row_of(pod):
        return lambda m: m["type"] == "frame" and any(r["pod"] == pod for r in m["pods"])

    async def scenario():
        comm = communicator("/ws/dashboard/", cookie=cookie)
        assert (await comm.connect())[0]
        await comm.receive_json_from(timeout=5)  # history

        pub = await sync_to_async(harness.publisher)("pod-a")
        await sync_to_async(housekeeping.run_once)()  # snapshot 1: the pod, nothing stored
        frame = await receive_until(comm, row_of("pod-a"))
        [row] = frame["pods"]
        assert (row["blocks"], row["status"], row["stored_per_s"]) == (0, "active", None)

        pub.send([stored_event(base_capture)])
        await sync_to_async(harness.sync)("pod-a")
        started = time.monotonic()
        await sync_to_async(housekeeping.run_once)()  # snapshot 2: rates and an activity entry
        frame = await receive_until(
            comm, lambda m: m["type"] == "frame" and m["pods"] and m["pods"][0]["stored_per_s"]
        )
        latency = time.monotonic() - started
        [row] = frame["pods"]
        assert row["blocks"] == 25
        assert row["blocks_by_tier"] == {"gpu": 25}
        assert row["hash_alignment"] == 1.0  # the capture's engine hashes are our keys
        assert row["stored_per_s"] > 0
        assert frame["totals"]["ingest_processes"] == 1

        pub.send([BlockRemoved(block_hashes=tuple(base_capture["block_hashes"][20:25]), tier="gpu")])
        await sync_to_async(harness.sync)("pod-a")
        frame = await receive_until(comm, lambda m: m["type"] == "frame" and m["pods"][0]["blocks"] == 20)
        await comm.disconnect()

        detail = communicator("/ws/dashboard/pods/pod-a/", cookie=cookie)
        assert (await detail.connect())[0]
        history = await detail.receive_json_from(timeout=5)
        pod_frame = await receive_until(detail, lambda m: m["type"] == "frame")
        await detail.disconnect()
        return latency, history, pod_frame

    latency, history, pod_frame = async_to_sync(scenario)()
    assert latency < 1.0
    assert history["pod"] == "pod-a"
    assert history["t"] and len(history["blocks"]) == len(history["t"])
    assert set(pod_frame["pod"]) == ROW_FIELDS
    assert pod_frame["pod"]["blocks"] == 20
    assert pod_frame["log"][0]["blocks_stored"] == 25  # newest first: the store of snapshot 2
    assert history["log"] == pod_frame["log"]


def test_the_charts_are_the_history_ingest_recorded_while_no_page_was_open(
    staff_user, pipeline, base_capture
):
    harness, housekeeping = pipeline
    pub = harness.publisher("pod-a")
    pub.send([stored_event(base_capture)])
    harness.sync("pod-a")
    for _ in range(3):  # three seconds' housekeeping, nobody watching
        housekeeping.run_once()
        time.sleep(0.6)
    cookie = session_cookie(staff_user)

    async def history(path: str) -> dict:
        comm = communicator(path, cookie=cookie)
        assert (await comm.connect())[0]
        message = await comm.receive_json_from(timeout=5)
        await comm.disconnect()
        return message

    fleet = async_to_sync(history)("/ws/dashboard/")
    assert (fleet["type"], fleet["seconds"], fleet["step"]) == ("history", 600, 1)
    assert len(fleet["t"]) >= 2 and fleet["t"] == sorted(fleet["t"])
    assert fleet["pods"]["pod-a"][-1] == 25
    assert fleet["events_per_s"][-1] is not None
    sampler_module.reset_sampler()  # another web process, or this one restarted: the same charts
    assert async_to_sync(history)("/ws/dashboard/") == fleet
    pod = async_to_sync(history)("/ws/dashboard/pods/pod-a/")
    assert (pod["t"], pod["blocks"][-1]) == (fleet["t"], 25)


def test_frames_bring_the_points_recorded_since_and_the_page_may_ask_for_another_span(staff_user, pipeline):
    harness, housekeeping = pipeline
    harness.publisher("pod-a")
    housekeeping.run_once()
    cookie = session_cookie(staff_user)

    async def scenario():
        comm = communicator("/ws/dashboard/", cookie=cookie)
        assert (await comm.connect())[0]
        history = await comm.receive_json_from(timeout=5)
        await sync_to_async(time.sleep)(1.0)
        await sync_to_async(housekeeping.run_once)()  # a new second: a new point
        frame = await receive_until(comm, lambda m: m["type"] == "frame" and m["chart"]["t"])
        await comm.send_to(text_data="not what the page sends")  # ignored
        await comm.send_json_to({"history_seconds": 86400})
        day = await receive_until(comm, lambda m: m["type"] == "history")
        await comm.send_json_to({"history_seconds": 1})  # at least a minute
        minute = await receive_until(comm, lambda m: m["type"] == "history")
        await comm.disconnect()
        return history, frame, day, minute

    history, frame, day, minute = async_to_sync(scenario)()
    assert frame["chart"]["t"][0] > history["t"][-1]
    assert "pod-a" in frame["chart"]["pods"]
    assert (day["seconds"], day["step"]) == (86400, 10)  # the 24-hour level: a point every 10 s
    assert day["t"] and all(t % 10 == 0 for t in day["t"])
    assert (minute["seconds"], minute["step"]) == (60, 1)


def test_a_frame_tells_the_five_pod_states_apart(staff_user, memory_index):
    """Active: an event within DASHBOARD_STALE_SECONDS; idle: none since, but the prober finds it
    up; stale: none since and nothing vouches for it (or it serves without sending events);
    down: the prober finds /health failing; disabled: the registry says so."""
    now = datetime.now(UTC)
    long_ago = now - timedelta(minutes=10)
    for pod_id, last_seen, health, enabled in [
        ("p-active", now, "up", True),
        ("p-idle", long_ago, "up", True),
        ("p-stale", long_ago, "unknown", True),
        ("p-busy", long_ago, "busy", True),
        ("p-down", now, "down", True),
        ("p-disabled", now, "up", False),
    ]:
        Pod.objects.create(pod_id=pod_id, model=MODEL, last_seen=last_seen, health=health, enabled=enabled)
    cookie = session_cookie(staff_user)

    async def frame() -> dict:
        comm = communicator("/ws/dashboard/", cookie=cookie)
        assert (await comm.connect())[0]
        message = await receive_until(comm, lambda m: m["type"] == "frame")
        await comm.disconnect()
        return message

    message = async_to_sync(frame)()
    assert {r["pod"]: r["status"] for r in message["pods"]} == {
        "p-active": "active",
        "p-idle": "idle",
        "p-stale": "stale",
        "p-busy": "stale",
        "p-down": "down",
        "p-disabled": "disabled",
    }
    totals = message["totals"]
    assert [totals[s] for s in ("active", "idle", "stale", "down", "disabled")] == [1, 1, 2, 1, 1]


def test_housekeeping_survives_a_broken_channel_layer(settings, caplog, transactional_db):
    settings.KVCACHE_INDEX_BACKEND = "memory"
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": ["redis://127.0.0.1:1/0"]},
        }
    }
    from ingest.stats import IngestStats

    housekeeping = Housekeeping(IngestStats())
    housekeeping.run_once()
    housekeeping.close()
    assert "could not send ingest stats to the channel layer" in caplog.text
