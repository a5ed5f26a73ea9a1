"""The liveness prober against real servers: a simulated fleet whose pod stops serving and serves
again, a closed port, a server that accepts and never answers, one that answers 503; what a down
pod does to scores and, after ``forget_seconds``, to the index; the registry writes behind it
(health, expiry)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import uvicorn

from ingest.service import Housekeeping
from ingest.stats import IngestStats
from kvindex import KVIndex, StoredBlock, open_index
from kvindex.keys import block_digest, block_keys, key_of, root_digest
from registry.config import ServiceConfig
from registry.liveness import HealthChange, LivenessProber, LivenessSettings, pod_state, probe_targets
from registry.models import Pod
from registry.runtime import service_config
from registry.services import expire_pods, save_pod, set_pod_health
from scoring.read_path import score_token_ids
from simulator.config import LatencyConfig
from simulator.fleet import Fleet, FleetConfig, PublishConfig
from simulator.fleet import FleetThread as BaseFleetThread
from simulator.pod import PodTokenizer
from simulator.server import create_app
from tests.servers import free_port, wait_until
from tests.simulator.conftest import MODEL, pod_config
from tokenization.tokenizers import TokenizerRegistry

FAST = LivenessSettings(interval=0.05, timeout=0.5, down_seconds=0.5, forget_seconds=0)


# --- real servers ------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """A uvicorn server that leaves signals alone (it runs in a test's thread)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class FleetThread(BaseFleetThread):
    """The shared fleet thread, plus taking one pod's HTTP server down and up again."""

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.fleet.pods[i].port}"

    def stop_serving(self, i: int) -> None:
        """Pod ``i``'s HTTP server shuts down and its port closes (connections are refused)."""

        async def stop() -> None:
            pod = self.fleet.pods[i]
            pod.server.should_exit = True
            await pod.task

        self.call(stop())

    def serve_again(self, i: int) -> None:
        """Pod ``i`` (the same engine, cache and all) serves HTTP again on its port."""

        async def start() -> None:
            pod = self.fleet.pods[i]
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", pod.port))
            config = uvicorn.Config(create_app(pod.pod), lifespan="off", log_config=None, access_log=False)
            pod.server = _Server(config)
            pod.task = asyncio.create_task(pod.server.serve(sockets=[sock]))
            while not pod.server.started:
                await asyncio.sleep(0.01)

        self.call(start())


class HangingServer:
    """Accepts connections and reads what they send, but never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4096)
        self.sock.setblocking(False)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.sock, selectors.EVENT_READ)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                if key.fileobj is self.sock:
                    with contextlib.suppress(BlockingIOError):
                        conn, _ = self.sock.accept()
                        conn.setblocking(False)
                        self._selector.register(conn, selectors.EVENT_READ)
                        self.accepted += 1
                    continue
                try:
                    data = key.fileobj.recv(65536)
                except OSError:
                    data = b""
                if not data:  # the client gave up: let the socket go
                    self._selector.unregister(key.fileobj)
                    key.fileobj.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()


class _Unavailable(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def qwen() -> PodTokenizer:
    return PodTokenizer(TokenizerRegistry(), MODEL)


@pytest.fixture
def fleet(qwen: PodTokenizer) -> Iterator[FleetThread]:
    """Two simulated pods, sim-0 and sim-1, on free ports; they publish no events."""
    config = FleetConfig(pod=pod_config(), pods=2, base_port=0, publish=PublishConfig(endpoint=None))
    running = FleetThread(Fleet(config, tokenizer=qwen, graceful_timeout=0.2))
    yield running
    running.close()


@pytest.fixture
def hanging() -> Iterator[HangingServer]:
    server = HangingServer()
    yield server
    server.close()


@pytest.fixture
def unavailable() -> Iterator[str]:
    """The address of a server that answers every request 503."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[KVIndex]:
    url = "memory://" if request.param == "memory" else request.getfixturevalue("redis_url")
    idx = open_index(url)
    yield idx
    idx.close()


def cache_blocks(index: KVIndex, *, pod: str, n: int = 3) -> None:
    digest = root_digest("")
    blocks = []
    for i in range(n):
        digest = block_digest(digest, list(range(i * 16, (i + 1) * 16)))
        blocks.append(StoredBlock(key_of(digest), key_of(digest), digest))
    index.store(model=MODEL, pod=pod, tier="gpu", blocks=blocks)


def blocks_of(index: KVIndex, pod: str) -> int:
    return sum(row.total for row in index.pod_blocks() if row.pod == pod)


# --- the prober ----------------------------------------------------------------------------------


def test_a_pod_that_stops_serving_is_down_after_down_seconds_and_up_again_once_it_serves(fleet):
    changes: list[HealthChange] = []
    returned: list[str] = []
    prober = LivenessProber(
        targets=lambda: {"sim-0": fleet.address(0), "sim-1": fleet.address(1)},
        on_change=changes.extend,
        on_return=returned.append,
        settings=FAST,
    )
    prober.start()
    try:
        wait_until(lambda: prober.health() == {"sim-0": "up", "sim-1": "up"}, what="both pods up")

        stopped = time.monotonic()
        fleet.stop_serving(1)
        wait_until(lambda: prober.health()["sim-1"] == "down", timeout=5, what="sim-1 down")
        # From the start of the first failed probe (which may have begun a few ms before the stop).
        assert time.monotonic() - stopped >= FAST.down_seconds - 0.05
        assert prober.health()["sim-0"] == "up"

        fleet.serve_again(1)
        wait_until(lambda: prober.health()["sim-1"] == "up", timeout=5, what="sim-1 up again")
    finally:
        prober.stop()
    assert [(c.pod, c.previous, c.health) for c in changes] == [
        ("sim-0", "unknown", "up"),
        ("sim-1", "unknown", "up"),
        ("sim-1", "up", "down"),
        ("sim-1", "down", "up"),
    ]
    assert returned == ["sim-1"]  # back after being down (its engine may have restarted): only then
    assert prober.stats.failures["connect"] > 0


def test_refused_hanging_and_unavailable_pods_all_fail_within_the_timeout(hanging, unavailable):
    closed = f"127.0.0.1:{free_port()}"
    settings = LivenessSettings(timeout=0.3, down_seconds=0)
    prober = LivenessProber(
        targets=lambda: {"refused": closed, "hanging": hanging.address, "unavailable": unavailable},
        settings=settings,
    )
    started = time.monotonic()
    changes = prober.probe_once()
    assert time.monotonic() - started < settings.timeout + 0.5
    assert sorted((c.pod, c.health) for c in changes) == [
        ("hanging", "down"),
        ("refused", "down"),
        ("unavailable", "down"),
    ]
    assert dict(prober.stats.failures) == {"connect": 1, "timeout": 1, "status": 1}
    assert hanging.accepted == 1  # it did accept: the request went unanswered


def test_a_thousand_hanging_pods_take_bounded_threads_and_time(hanging):
    settings = LivenessSettings(timeout=0.2, down_seconds=0, concurrency=128)
    targets = {f"pod-{i}": hanging.address for i in range(1000)}
    prober = LivenessProber(targets=lambda: targets, settings=settings)
    baseline, most = threading.active_count(), [0]
    done = threading.Event()

    def count_threads() -> None:
        while not done.is_set():
            most[0] = max(most[0], threading.active_count())
            time.sleep(0.005)

    counter = threading.Thread(target=count_threads)
    counter.start()
    started, cpu = time.monotonic(), time.process_time()
    try:
        prober.probe_once()
    finally:
        done.set()
        counter.join()
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
    assert prober.stats.failures["timeout"] == 1000
    # About 8 rounds of in-flight probes waiting out their timeout, plus the work of making 1,000
    # connections (seconds of CPU on this machine; a busy machine stretches it): one at a time
    # they would take 200 s of waiting.
    assert elapsed < (1000 / 128 + 1) * settings.timeout + 3 * cpu + 2.0, (elapsed, cpu)
    assert most[0] - baseline < 40  # one loop thread (+ the event loop's small resolver pool)


def test_down_pods_are_forgotten_once_after_forget_seconds_ranks_too(index):
    cache_blocks(index, pod="gone")
    cache_blocks(index, pod="gone#dp1")
    cache_blocks(index, pod="kept")
    settings = LivenessSettings(timeout=0.3, down_seconds=0, forget_seconds=0.3)
    closed = f"127.0.0.1:{free_port()}"
    prober = LivenessProber(targets=lambda: {"gone": closed}, index=index, settings=settings)

    assert [(c.pod, c.health) for c in prober.probe_once()] == [("gone", "down")]
    assert blocks_of(index, "gone") == 3  # down: out of scores, but its blocks stay for now
    time.sleep(settings.forget_seconds)
    prober.probe_once()
    assert (blocks_of(index, "gone"), blocks_of(index, "gone#dp1"), blocks_of(index, "kept")) == (0, 0, 3)
    assert prober.stats.forgotten == 1

    cache_blocks(index, pod="gone")  # it published again, still unreachable: cleared only once
    prober.probe_once()
    assert blocks_of(index, "gone") == 3
    assert prober.stats.forgotten == 1


def test_only_enabled_pods_with_an_address_are_probed_and_a_pod_dropped_is_unknown_again(hanging):
    config = ServiceConfig(
        pod_addresses={"a": hanging.address, "b": hanging.address},
        disabled_pods=frozenset({"b"}),
    )
    assert probe_targets(config) == {"a": hanging.address}  # "c" has no address: not there at all

    targets = {"a": hanging.address}
    prober = LivenessProber(targets=lambda: targets, settings=LivenessSettings(timeout=0.1, down_seconds=0))
    assert [(c.pod, c.health) for c in prober.probe_once()] == [("a", "down")]
    targets = {}
    assert [(c.pod, c.health) for c in prober.probe_once()] == [("a", "unknown")]
    assert prober.health() == {}


def test_a_failing_report_is_offered_again_with_the_next_round(hanging):
    reported: list[list[tuple[str, str]]] = []
    failures = iter([True, False])

    def on_change(changes: list[HealthChange]) -> None:
        reported.append([(c.pod, c.health) for c in changes])
        if next(failures):
            raise RuntimeError("the registry is down")

    prober = LivenessProber(
        targets=lambda: {"a": hanging.address},
        on_change=on_change,
        settings=LivenessSettings(timeout=0.1, down_seconds=0),
    )
    prober.probe_once()
    prober.probe_once()
    assert reported == [[("a", "down")], [("a", "down")]]


# --- with the registry ---------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_down_pod_leaves_scores_and_returns_to_them(fleet, process_index):
    token_ids = list(range(64))
    keys = block_keys(token_ids, seed=service_config().seed, block_size=16)
    for pod in ("sim-0", "sim-1", "sim-1#dp1"):
        process_index.store(
            model=MODEL, pod=pod, tier="gpu", blocks=[StoredBlock(k, k, k.to_bytes(8, "big")) for k in keys]
        )
    for i in range(2):
        save_pod(Pod(pod_id=f"sim-{i}", model=MODEL, address=fleet.address(i)))
    prober = LivenessProber(
        targets=lambda: probe_targets(service_config()), on_change=set_pod_health, settings=FAST
    )

    def scored() -> set[str]:
        config = service_config()
        result = score_token_ids(index=process_index, config=config, model=MODEL, token_ids=token_ids)
        return set(result.scores)

    prober.probe_once()
    assert dict(Pod.objects.values_list("pod_id", "health")) == {"sim-0": "up", "sim-1": "up"}
    assert scored() == {"sim-0", "sim-1", "sim-1#dp1"}

    def sim_1_down() -> bool:
        prober.probe_once()
        return Pod.objects.get(pod_id="sim-1").health == "down"

    fleet.stop_serving(1)
    wait_until(sim_1_down, timeout=5, what="sim-1 down in the registry")
    assert service_config().down_pods == {"sim-1"}
    assert scored() == {"sim-0"}  # the pod and its data-parallel rank
    asked = score_token_ids(
        index=process_index, config=service_config(), model=MODEL, token_ids=token_ids, pods=["sim-1"]
    )
    assert (asked.scores, asked.looked_up) == ({}, False)

    fleet.serve_again(1)
    prober.probe_once()
    assert Pod.objects.get(pod_id="sim-1").health == "up"
    assert scored() == {"sim-0", "sim-1", "sim-1#dp1"}


@pytest.mark.django_db
def test_set_pod_health_records_real_changes_only():
    Pod.objects.create(pod_id="a", model=MODEL)
    at = time.time() - 30
    assert set_pod_health([HealthChange("a", "down", at), HealthChange("gone", "down", at)]) == 1
    pod = Pod.objects.get(pod_id="a")
    assert (pod.health, pod.health_changed_at.timestamp()) == ("down", pytest.approx(at))
    assert service_config().down_pods == {"a"}  # the snapshot was invalidated

    assert set_pod_health([HealthChange("a", "down", time.time())]) == 0
    assert Pod.objects.get(pod_id="a").health_changed_at.timestamp() == pytest.approx(at)
    with pytest.raises(ValueError, match="health must be one of"):
        set_pod_health([HealthChange("a", "sleepy", at)])


@pytest.mark.django_db
def test_an_admin_save_keeps_the_probers_verdict_unless_the_address_changes(process_index):
    form = Pod.objects.create(pod_id="a", model=MODEL, address="10.0.0.1:8000")  # read before the verdict
    set_pod_health([HealthChange("a", "down", time.time())])

    form.labels = {"zone": "b"}
    save_pod(form)
    assert Pod.objects.get(pod_id="a").health == "down"
    assert form.health == "down"

    form.address = "10.0.0.2:8000"  # judged afresh at the new address
    save_pod(form)
    assert Pod.objects.get(pod_id="a").health == "unknown"
    assert "a" not in service_config().down_pods


# --- registry expiry -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_expiry_deletes_pods_long_unheard_of_and_clears_their_blocks(process_index):
    now = datetime.now(UTC)
    old = now - timedelta(days=8)
    Pod.objects.create(pod_id="old", model=MODEL, first_seen=old, last_seen=old)
    Pod.objects.create(pod_id="recent", model=MODEL, first_seen=old, last_seen=now - timedelta(days=1))
    Pod.objects.create(pod_id="by-hand", model=MODEL)  # never seen by ingest
    Pod.objects.create(pod_id="off", model=MODEL, first_seen=old, last_seen=old, enabled=False)
    for pod in ("old", "old#dp1", "recent"):
        cache_blocks(process_index, pod=pod)
    service_config()

    assert expire_pods(last_seen_before=now - timedelta(days=7)) == ["old"]
    assert sorted(Pod.objects.values_list("pod_id", flat=True)) == ["by-hand", "off", "recent"]
    assert (blocks_of(process_index, "old"), blocks_of(process_index, "old#dp1")) == (0, 0)
    assert blocks_of(process_index, "recent") == 3


@pytest.mark.django_db
def test_housekeeping_expires_at_most_once_a_minute(settings, process_index):
    settings.KVCACHE_INDEX_BACKEND = "memory"
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
    settings.KVCACHE_POD_EXPIRE_DAYS = 7
    old = datetime.now(UTC) - timedelta(days=8)
    Pod.objects.create(pod_id="old-1", model=MODEL, first_seen=old, last_seen=old)
    housekeeping = Housekeeping(IngestStats())
    try:
        housekeeping.run_once()
        assert not Pod.objects.filter(pod_id="old-1").exists()
        Pod.objects.create(pod_id="old-2", model=MODEL, first_seen=old, last_seen=old)
        housekeeping.run_once()
        assert Pod.objects.filter(pod_id="old-2").exists()  # the next look is a minute later
    finally:
        housekeeping.close()


def test_a_quiet_pod_that_serves_is_busy_and_up_again_when_it_stops(qwen):
    """Busy: healthy and serving, yet no KV event arrives (ingest says it is quiet): what the
    index holds of it goes stale (``pod_state`` says so)."""
    slow = dataclasses.replace(pod_config(), latency=LatencyConfig(inter_token_latency_ms=50))
    config = FleetConfig(pod=slow, pods=1, base_port=0, publish=PublishConfig(endpoint=None))
    fleet = FleetThread(Fleet(config, tokenizer=qwen, graceful_timeout=0.2))
    quiet = {"sim-0"}
    changes: list[HealthChange] = []
    prober = LivenessProber(
        targets=lambda: {"sim-0": fleet.address(0)},
        on_change=changes.extend,
        settings=FAST,
        quiet=lambda: quiet,
    )
    try:
        prober.probe_once()
        assert prober.health() == {"sim-0": "up"}  # quiet but not serving: idle
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 60, "ignore_eos": True}
        request = threading.Thread(
            target=lambda: httpx.post(f"http://{fleet.address(0)}/v1/completions", json=body, timeout=30)
        )
        request.start()
        wait_until(lambda: prober.probe_once() or prober.health()["sim-0"] == "busy", what="busy")
        quiet.clear()  # its events arrive again: whatever it serves, it is up
        prober.probe_once()
        assert prober.health() == {"sim-0": "up"}
        request.join(30)
    finally:
        fleet.close()
    assert [c.health for c in changes] == ["up", "busy", "up"]
    state = pod_state(enabled=True, health="busy", last_event_age=None, stale_after=60.0)
    assert state == "stale"
    assert pod_state(enabled=True, health="up", last_event_age=None, stale_after=60.0) == "idle"
