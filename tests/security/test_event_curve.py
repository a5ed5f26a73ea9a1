"""CURVE on the KV-event port (issue 27, trust boundaries), on real ZeroMQ sockets: with
``KVCACHE_INGEST_CURVE_*``, a real ``manage.py ingest`` hears only the publishers whose keys it
lists (a real ``manage.py simulate`` among them), connects to CURVE engines as their client, and
refuses missing or malformed keys before it starts; replays come over CURVE from engines that
serve them so."""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import zmq
from django.core.management import CommandError, call_command

from ingest.curve import EventCurve, load_key_pair, load_public_key
from ingest.events import BlockStored, encode_batch, encode_message
from ingest.pool import Receiver
from ingest.replay import ReplayFailed, fetch_replay
from ingest.stats import IngestStats
from kvindex import open_index
from registry.config import ServiceConfig
from scoring.read_path import score_token_ids
from simulator.management.commands.simulate import Command as Simulate
from simulator.management.commands.simulate import fleet_config
from simulator.publisher import EventPublisher
from tests.servers import free_port, service_env, wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "Qwen/Qwen3-0.6B"
SEED = "42"  # service_env's KVCACHE_HASH_SEED
BLOCK = 16


@dataclass(frozen=True)
class Keys:
    """Certificates made by ``manage.py curve_keys``: ``ingest``, ``engine`` (listed in
    ``clients``, the directory ingest admits) and ``stranger`` (listed nowhere)."""

    root: Path

    @property
    def clients(self) -> Path:
        return self.root / "clients"

    def secret(self, name: str) -> Path:
        return self.root / f"{name}.key_secret"

    def public(self, name: str) -> Path:
        return self.root / f"{name}.key"

    def curve(self, name: str, *, server: str | None = None) -> EventCurve:
        """``name``'s key pair, as the client of ``server``'s public key when given."""
        return EventCurve(
            keys=load_key_pair(self.secret(name)),
            server_key=load_public_key(self.public(server)) if server else None,
        )

    def ingest_env(self, **extra: str) -> dict[str, str]:
        return {
            "KVCACHE_INGEST_CURVE_SECRET_KEY_FILE": str(self.secret("ingest")),
            "KVCACHE_INGEST_CURVE_CLIENTS_DIR": str(self.clients),
            **extra,
        }


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Keys:
    root = tmp_path_factory.mktemp("curve-keys")
    for name in ("ingest", "engine", "stranger"):
        call_command("curve_keys", out=str(root), name=name, stdout=io.StringIO())
    (root / "clients").mkdir()
    shutil.copy(root / "engine.key", root / "clients")
    return Keys(root)


@pytest.fixture(scope="module")
def registry_template(tmp_path_factory, redis_server) -> Path:
    """A migrated SQLite registry, copied by each test (migrating takes seconds)."""
    directory = tmp_path_factory.mktemp("curve-registry")
    env = service_env(directory, redis_server.url)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    return directory / "db.sqlite3"


class Ingest:
    """A real ``manage.py ingest`` (``args``, ``env`` on the test service environment) over the
    test Valkey and a registry of its own; the liveness prober off."""

    def __init__(self, tmp_path: Path, redis_url: str, template: Path, *args: str, **env: str) -> None:
        shutil.copy(template, tmp_path / "db.sqlite3")
        self.db = tmp_path / "db.sqlite3"
        self.log_path = tmp_path / "ingest.log"
        self.index = open_index(redis_url)
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "manage.py",
                    "ingest",
                    *args,
                    "--workers",
                    "1",
                    "--housekeeping-interval",
                    "0.2",
                ],
                cwd=ROOT,
                env=service_env(tmp_path, redis_url, KVCACHE_POD_DOWN_SECONDS="0", **env),
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def scores(self, tokens: list[int]) -> dict[str, int]:
        """Matched blocks per pod for ``tokens``, as the read path scores them."""
        config = ServiceConfig(seed=SEED, default_block_size=BLOCK)
        result = score_token_ids(index=self.index, config=config, model=MODEL, token_ids=tokens)
        return {pod: s.matched_blocks for pod, s in result.scores.items()}

    def pods(self) -> set[str]:
        """The pods the registry knows (ingest records every pod it hears from)."""
        with sqlite3.connect(self.db) as db:
            return {pod for (pod,) in db.execute("SELECT pod_id FROM scoring_pod")}

    def log(self) -> str:
        return self.log_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.index.close()


def prompt(n_blocks: int, first: int) -> list[int]:
    return list(range(first, first + n_blocks * BLOCK))


def stored(tokens: list[int]) -> BlockStored:
    """The engine cached the blocks of ``tokens`` (engine hashes made up from the first token)."""
    hashes = tuple(tokens[0] + i for i in range(len(tokens) // BLOCK))
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tuple(tokens), block_size=BLOCK)


class PlainPublisher:
    """A publisher without CURVE, as every engine's was before (and vLLM's is)."""

    def __init__(self, context: zmq.Context, endpoint: str, pod: str, *, bind: bool = False) -> None:
        self.pod, self.seq = pod, 0
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        if bind:
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)

    @property
    def bound_endpoint(self) -> str:
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: list) -> None:
        payload = encode_batch(events, ts=time.time(), layout="map")
        self.socket.send_multipart(encode_message(self.pod, MODEL, self.seq, payload))
        self.seq += 1

    def close(self) -> None:
        self.socket.close(0)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A context of the test's own; every socket is closed by the test (a socket's CURVE monitor
    thread closes its own when the socket closes), so terminating it does not wait."""
    context = zmq.Context()
    yield context
    context.term()


@pytest.mark.slow
def test_ingest_hears_an_allowed_key_and_never_a_stranger_a_plain_or_a_confused_publisher(
    tmp_path, redis_url, registry_template, keys, context
):
    """``--bind`` with CURVE: a real ``simulate`` publishing with the engine's listed key pair is
    indexed; a publisher with an unlisted key, one without CURVE and one that has another key for
    ingest are never heard (nothing indexed or registered), ingest keeps running, keeps hearing
    the allowed one after them, and logs the refusals."""
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    ingest = Ingest(tmp_path, redis_url, registry_template, "--bind", endpoint, **keys.ingest_env())
    sim_port = free_port()
    simulate = subprocess.Popen(
        [
            sys.executable, "manage.py", "simulate", "--pods", "1", "--base-port", str(sim_port),
            "--events-endpoint", endpoint, "--prefill-overhead-ms", "0", "--inter-token-latency-ms", "0",
            "--curve-secret-key-file", str(keys.secret("engine")),
            "--curve-server-key-file", str(keys.public("ingest")),
        ],
        cwd=ROOT,
        env=service_env(tmp_path / "sim", redis_url),  # its own (unmigrated) registry: settings' defaults
        stdout=(tmp_path / "simulate.log").open("w"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    strangers = [
        # a key ingest does not list
        EventPublisher(context, endpoint=endpoint, pod_id="stranger-0", model=MODEL,
                       curve=keys.curve("stranger", server="ingest")),
        # a listed key, but it takes ingest for another server
        EventPublisher(context, endpoint=endpoint, pod_id="confused-0", model=MODEL,
                       curve=keys.curve("engine", server="stranger")),
        PlainPublisher(context, endpoint, "plain-0"),
    ]  # fmt: skip
    unheard = prompt(4, 60_000)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{sim_port}", timeout=10) as client:

            def serving() -> bool:
                assert simulate.poll() is None, (tmp_path / "simulate.log").read_text()
                try:
                    return client.get("/health").status_code == 200
                except httpx.TransportError:
                    time.sleep(0.1)
                    return False

            wait_until(serving, timeout=60, what="the simulated pod serving")
            attempt = iter(range(1_000, 31_000, 100))  # token ids within the model's vocabulary

            def completion_indexed() -> bool:
                """A new prompt through the simulated pod each time (a repeated one would hit its
                cache and publish nothing) until one lands: the first batches may leave before
                ingest's subscription has reached the publisher."""
                for publisher in strangers:
                    publisher.publish([stored(unheard)])
                assert ingest.proc.poll() is None, ingest.log()
                tokens = prompt(4, next(attempt))
                client.post("/v1/completions", json={"model": MODEL, "prompt": tokens, "max_tokens": 1})
                time.sleep(0.2)
                return ingest.scores(tokens).get("sim-0") == 4

            wait_until(completion_indexed, timeout=60, what="the allowed simulated pod indexed")

            for publisher in strangers:  # they go on; the allowed pod is still heard after them
                publisher.publish([stored(unheard)])
            later = prompt(4, 40_000)
            client.post("/v1/completions", json={"model": MODEL, "prompt": later, "max_tokens": 1})
            wait_until(lambda: ingest.scores(later).get("sim-0") == 4, what="the allowed pod heard again")

        wait_until(lambda: "sim-0" in ingest.pods(), what="the allowed pod registered")
        time.sleep(0.5)  # housekeeping registers what was heard every 0.2 s
        assert ingest.scores(unheard) == {}
        assert ingest.pods() & {"stranger-0", "confused-0", "plain-0"} == set()
        assert ingest.proc.poll() is None
        log = ingest.log()
        public = {name: load_public_key(keys.public(name)).decode() for name in ("ingest", "stranger")}
        assert f"CURVE, public key {public['ingest']}" in log
        assert f"its CURVE public key {public['stranger']} is not among the allowed keys" in log
        assert "(a publisher without CURVE?)" in log  # the plain one
        assert (
            "it does not decrypt (the peer has another public key for this server)" in log
        )  # the confused one
    finally:
        simulate.terminate()
        simulate.wait(15)
        for publisher in strangers:
            publisher.close()
        ingest.close()


@pytest.mark.slow
def test_ingest_connects_as_the_curve_client_of_engines_that_bind(
    tmp_path, redis_url, registry_template, keys, context
):
    """``--connect`` with CURVE: ingest is the client of the engines' bound PUBs, which serve with
    the key pair whose public key KVCACHE_INGEST_CURVE_SERVER_KEY_FILE holds; an engine that does
    not speak CURVE is never heard."""
    engine = EventPublisher(
        context, endpoint="tcp://127.0.0.1:*", pod_id="engine-0", model=MODEL, curve=keys.curve("engine")
    )
    plain = PlainPublisher(context, "tcp://127.0.0.1:*", "plain-0", bind=True)
    env = {
        "KVCACHE_INGEST_CURVE_SECRET_KEY_FILE": str(keys.secret("ingest")),
        "KVCACHE_INGEST_CURVE_SERVER_KEY_FILE": str(keys.public("engine")),
    }
    ingest = Ingest(
        tmp_path, redis_url, registry_template,
        "--connect", engine.bound_endpoint, "--connect", plain.bound_endpoint, **env,
    )  # fmt: skip
    heard, unheard = prompt(4, 10_000), prompt(4, 20_000)
    try:

        def indexed() -> bool:
            assert ingest.proc.poll() is None, ingest.log()
            engine.publish([stored(heard)])  # stores are idempotent: re-sent until subscribed
            plain.publish([stored(unheard)])
            time.sleep(0.1)
            return ingest.scores(heard).get("engine-0") == 4

        wait_until(indexed, timeout=60, what="the CURVE engine indexed")
        for _ in range(5):
            plain.publish([stored(unheard)])
        time.sleep(0.5)
        assert ingest.scores(unheard) == {}
        assert ingest.proc.poll() is None
    finally:
        engine.close()
        plain.close()
        ingest.close()


def test_a_curve_port_without_its_zap_handler_admits_no_one(keys, context):
    """The bound sockets enforce their ZAP domain: were the authenticator not started, no key at
    all would be admitted (libzmq's default without a handler is to admit every key)."""
    received: list = []

    class Collect:
        def shard(self, pod: str) -> int:
            return 0

        def forget_pod(self, pod: str) -> None:
            pass

        def submit_parcel(self, worker: int, items: list) -> None:
            received.extend(items)

    curve = EventCurve(
        keys=load_key_pair(keys.secret("ingest")), allowed=frozenset([_public(keys, "engine")])
    )
    receiver = Receiver(
        pool=Collect(), stats=IngestStats(), bind=["tcp://127.0.0.1:*"], context=context, curve=curve
    )
    thread = threading.Thread(target=receiver.run, daemon=True)
    thread.start()
    allowed = EventPublisher(
        context,
        endpoint=receiver.bound[0],
        pod_id="engine-0",
        model=MODEL,
        curve=keys.curve("engine", server="ingest"),
    )
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            allowed.publish([stored(prompt(1, 0))])
            time.sleep(0.02)
        assert received == []
    finally:
        receiver.stop()
        thread.join(5)
        allowed.close()


def test_a_replica_s_managed_connections_speak_curve(keys, context):
    """Replica mode (``ingest.membership``): the socket whose connections follow the pods held is
    a CURVE client too; a plain engine among the held endpoints is never heard."""
    received: list = []

    class Collect:
        def shard(self, pod: str) -> int:
            return 0

        def forget_pod(self, pod: str) -> None:
            pass

        def submit_parcel(self, worker: int, items: list) -> None:
            received.extend(items)

    engine = EventPublisher(
        context, endpoint="tcp://127.0.0.1:*", pod_id="engine-0", model=MODEL, curve=keys.curve("engine")
    )
    plain = PlainPublisher(context, "tcp://127.0.0.1:*", "plain-0", bind=True)
    receiver = Receiver(
        pool=Collect(),
        stats=IngestStats(),
        context=context,
        managed_connect=True,
        curve=keys.curve("ingest", server="engine"),
    )
    receiver.set_connected([engine.bound_endpoint, plain.bound_endpoint])
    thread = threading.Thread(target=receiver.run, daemon=True)
    thread.start()
    try:

        def heard() -> bool:
            engine.publish([stored(prompt(1, 0))])
            plain.publish([stored(prompt(1, 0))])
            time.sleep(0.02)
            return any(item.pod == "engine-0" for item in received)

        wait_until(heard, timeout=10, what="the CURVE engine heard")
        for _ in range(20):
            plain.publish([stored(prompt(1, 0))])
            time.sleep(0.01)
        assert {item.pod for item in received} == {"engine-0"}
    finally:
        receiver.stop()
        thread.join(5)
        engine.close()
        plain.close()


@contextlib.contextmanager
def replaying(publisher: EventPublisher) -> Iterator[EventPublisher]:
    """``publisher`` answering replay requests from a loop in a thread of its own."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(publisher.serve_replay())
    thread = threading.Thread(target=lambda: loop.run_until_complete(asyncio.wait([task])), daemon=True)
    thread.start()
    try:
        yield publisher
    finally:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(5)
        publisher.close()
        loop.close()


def test_replays_come_over_curve_from_an_engine_that_serves_them(keys, context):
    """The replay DEALER is a CURVE client with the engines' public key: an engine whose ROUTER
    serves with that key pair answers; a plain ROUTER, or another key, answers nothing (a timeout:
    the pod is cleared until it stores again, never fed what a stranger sends)."""
    curve_engine = EventPublisher(
        context, endpoint="tcp://127.0.0.1:*", pod_id="engine-0", model=MODEL,
        replay_endpoint="tcp://127.0.0.1:*", curve=keys.curve("engine"),
    )  # fmt: skip
    plain_engine = EventPublisher(
        context,
        endpoint="tcp://127.0.0.1:*",
        pod_id="plain-0",
        model=MODEL,
        replay_endpoint="tcp://127.0.0.1:*",
    )
    with replaying(curve_engine), replaying(plain_engine):
        for engine in (curve_engine, plain_engine):
            for i in range(3):
                engine.publish([stored(prompt(1, i * BLOCK))])
        client = keys.curve("ingest", server="engine")
        batches = fetch_replay(context, curve_engine.replay_bound_endpoint, 1, timeout=5, curve=client)
        assert [seq for seq, _ in batches] == [1, 2]
        for endpoint, curve in [
            (plain_engine.replay_bound_endpoint, client),  # a ROUTER without CURVE
            (curve_engine.replay_bound_endpoint, keys.curve("ingest", server="stranger")),  # another key
            (curve_engine.replay_bound_endpoint, None),  # ingest without CURVE
        ]:
            with pytest.raises(ReplayFailed) as failed:
                fetch_replay(context, endpoint, 0, timeout=0.5, curve=curve)
            assert failed.value.reason == "timeout"


def _public(keys: Keys, name: str) -> bytes:
    return load_public_key(keys.public(name))


def broken_files(directory: Path, keys: Keys) -> None:
    """Key files and directories ingest must refuse, in ``directory``."""
    pair = keys.secret("ingest").read_text()
    (directory / "text").write_text("hello\n")
    (directory / "short.key_secret").write_text(pair.replace('secret-key = "', 'secret-key = "x'))
    ingest, engine = (_public(keys, name).decode() for name in ("ingest", "engine"))
    (directory / "mixed.key_secret").write_text(pair.replace(ingest, engine))
    (directory / "short.key").write_text('curve\n    public-key = "abcde"\n')
    (directory / "empty").mkdir()
    (directory / "bad").mkdir()
    (directory / "bad" / "bad.key").write_text("curve\n    not-a-key = 1\n")


SECRET = "KVCACHE_INGEST_CURVE_SECRET_KEY_FILE"
CLIENTS = "KVCACHE_INGEST_CURVE_CLIENTS_DIR"
SERVER = "KVCACHE_INGEST_CURVE_SERVER_KEY_FILE"


@pytest.mark.parametrize(
    ("secret", "clients", "server", "endpoint", "message"),
    [
        pytest.param("nowhere.key_secret", "clients", "", "bind", rf"{SECRET}: .*nowhere.key_secret is not",
                     id="secret key file missing"),
        pytest.param("ingest.key", "clients", "", "bind", r"holds no secret-key \(give the NAME.key_secret",
                     id="a public certificate for the key pair"),
        pytest.param("text", "clients", "", "bind", rf"{SECRET}: .*text is not a ZeroMQ certificate",
                     id="not a certificate"),
        pytest.param("short.key_secret", "clients", "", "bind", r"secret-key of .* is not a 40-character Z85",
                     id="secret key malformed"),
        pytest.param("mixed.key_secret", "clients", "", "bind", r"public-key of .* is not its secret-key's",
                     id="keys of two pairs"),
        pytest.param("ingest.key_secret", "nowhere", "", "bind", rf"{CLIENTS}: .*nowhere is not a directory",
                     id="clients dir missing"),
        pytest.param("ingest.key_secret", "empty", "", "bind", r"holds no public certificate \(NAME.key\)",
                     id="clients dir empty"),
        pytest.param("ingest.key_secret", "bad", "", "bind", rf"{CLIENTS}: .*bad.key is not a ZeroMQ cert",
                     id="a malformed client certificate"),
        pytest.param("ingest.key_secret", "", "", "bind", rf"CURVE on --bind needs {CLIENTS}",
                     id="bind without clients dir"),
        pytest.param("ingest.key_secret", "", "", "connect", rf"--connect or --replica needs {SERVER}",
                     id="connect without server key"),
        pytest.param("ingest.key_secret", "clients", "short.key", "bind", rf"{SERVER}: the public-key of",
                     id="server key malformed"),
        pytest.param("", "clients", "", "bind", rf"need {SECRET}, ingest's own key pair",
                     id="clients dir without a key pair"),
    ],
)  # fmt: skip
def test_ingest_refuses_missing_or_malformed_curve_settings(
    secret, clients, server, endpoint, message, keys, tmp_path, settings
):
    """Checked before anything starts (no index, no socket): a CURVE setting ingest cannot use
    is a CommandError that names the setting and the file."""
    broken_files(tmp_path, keys)

    def path(name: str) -> str:
        if not name:
            return ""
        return str(keys.root / name if (keys.root / name).exists() else tmp_path / name)

    settings.KVCACHE_INGEST_CURVE_SECRET_KEY_FILE = path(secret)
    settings.KVCACHE_INGEST_CURVE_CLIENTS_DIR = path(clients)
    settings.KVCACHE_INGEST_CURVE_SERVER_KEY_FILE = path(server)
    with pytest.raises(CommandError, match=message):
        call_command("ingest", **{endpoint: ["tcp://127.0.0.1:1"]})


def test_a_curve_setting_ingest_cannot_use_stops_the_process_at_once(tmp_path, redis_url, keys):
    """The real command: it exits 1 with the reason, before it waits for the index or binds."""
    env = service_env(
        tmp_path, redis_url, KVCACHE_INGEST_CURVE_SECRET_KEY_FILE=str(tmp_path / "ingest.key_secret"),
        KVCACHE_INGEST_CURVE_CLIENTS_DIR=str(keys.clients),
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "manage.py", "ingest", "--bind", "tcp://127.0.0.1:1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert (
        f"KVCACHE_INGEST_CURVE_SECRET_KEY_FILE: {tmp_path / 'ingest.key_secret'} is not a file" in done.stderr
    )


def test_curve_keys_writes_a_pair_and_never_overwrites_it(tmp_path):
    out = tmp_path / "keys"
    call_command("curve_keys", out=str(out), name="engine-0", stdout=io.StringIO())
    pair = load_key_pair(out / "engine-0.key_secret")
    assert load_public_key(out / "engine-0.key") == pair.public
    assert (out / "engine-0.key_secret").stat().st_mode & 0o077 == 0  # the owner's alone
    with pytest.raises(CommandError, match="exists: a key is never overwritten"):
        call_command("curve_keys", out=str(out), name="engine-0", stdout=io.StringIO())
    assert load_key_pair(out / "engine-0.key_secret") == pair


def test_simulate_publishes_over_curve_only_knowing_ingest_s_public_key(keys):
    """A pod's PUB that connects to ingest needs ingest's public key; one that binds does not."""

    def config(*argv: str):
        options = vars(Simulate().create_parser("manage.py", "simulate").parse_args(list(argv)))
        return fleet_config(options, registry=ServiceConfig())

    secret = ("--curve-secret-key-file", str(keys.secret("engine")))
    with pytest.raises(ValueError, match="needs ingest's public key"):
        config("--events-endpoint", "tcp://127.0.0.1:5557", *secret)
    assert config("--events-endpoint", "tcp://*:5557", *secret).publish.curve == keys.curve("engine")
    connected = config(*secret, "--curve-server-key-file", str(keys.public("ingest"))).publish.curve
    assert connected == keys.curve("engine", server="ingest")
    assert config().publish.curve is None
