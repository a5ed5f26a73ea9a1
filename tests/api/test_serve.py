"""``manage.py serve`` as operators run it: a real uvicorn with two worker processes on the test
Redis. Chunked bodies are read, probes answer whatever the Host header, metrics add up over the
workers, and SIGTERM under load drains and exits 0 within 10 seconds."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dashboard.conftest import ROOT, Process
from tests.servers import free_port, service_env, wait_until

MODEL = "Qwen/Qwen3-0.6B"


@pytest.fixture
def server(tmp_path: Path, redis_url: str) -> Iterator[dict]:
    env = service_env(tmp_path, redis_url, HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    port = free_port()
    web = Process(
        [sys.executable, "manage.py", "serve", "--port", str(port), "--workers", "2"],
        env,
        tmp_path / "web.log",
    )
    web.start()
    try:
        wait_until(lambda: _status(port, "GET", "/healthz") == 200, timeout=30, what="serve to answer")
        yield {"port": port, "web": web}
    finally:
        web.stop()


def _status(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> int:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        response.read()
        connection.close()
        return response.status
    except OSError:
        return 0


def _post(port: int, path: str, body: object) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = response.status, json.loads(response.read())
    connection.close()
    return answer


def test_a_chunked_body_is_read(server):
    body = json.dumps({"model": MODEL, "token_ids": list(range(64))}).encode()
    connection = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=10)
    connection.request("POST", "/api/v1/score", body=iter([body[:10], body[10:]]), encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 200, response.read()
    assert json.loads(response.read())["blocks"] == 4


def test_probes_answer_any_host_header_and_the_rest_checks_it(server):
    port = server["port"]
    pod_ip = {"Host": "10.1.2.3:8000"}  # what a Kubernetes probe sends
    assert _status(port, "GET", "/healthz", headers=pod_ip) == 200
    assert _status(port, "GET", "/readyz", headers=pod_ip) == 200
    assert _status(port, "GET", "/api/schema/", headers=pod_ip) == 400
    assert _status(port, "GET", "/api/schema/", headers={"Host": "127.0.0.1"}) == 200


def test_metrics_add_up_over_the_workers(server):
    port = server["port"]
    for _ in range(20):  # over several connections: the kernel spreads them over both workers
        assert _post(port, "/api/v1/score", {"model": MODEL, "token_ids": [1] * 32})[0] == 200
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    line = next(
        line
        for line in text.splitlines()
        if line.startswith("kvcache_scoring_requests_total{")
        and 'endpoint="score"' in line
        and 'outcome="ok"' in line
    )
    assert float(line.rsplit(" ", 1)[1]) == 20


def test_sigterm_under_load_drains_and_exits_0_within_10_seconds(server):
    port, web = server["port"], server["web"]
    stop = threading.Event()
    answered: list[int] = []

    def hammer() -> None:
        deadline = time.monotonic() + 20
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                answered.append(_post(port, "/api/v1/score", {"model": MODEL, "token_ids": [1] * 2048})[0])
            except (OSError, http.client.HTTPException):
                answered.append(0)

    clients = [threading.Thread(target=hammer) for _ in range(16)]
    for client in clients:
        client.start()
    try:
        wait_until(lambda: len(answered) > 200, timeout=20, what="load")
        started = time.monotonic()
        web.proc.send_signal(signal.SIGTERM)
        code = web.proc.wait(timeout=15)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        for client in clients:
            client.join()
    assert code == 0
    assert elapsed < 10.0
    assert answered.count(200) > 200


@pytest.mark.parametrize(("command", "stop"), [("serve", signal.SIGTERM), ("gateway", signal.SIGINT)])
def test_one_worker_asked_to_stop_exits_0(tmp_path: Path, redis_url: str, command: str, stop: int) -> None:
    """uvicorn with one worker re-raises the signal it caught once it has stopped: the process
    must still exit 0 (under ``make run`` a stop that was asked for is a clean stop)."""
    env = service_env(tmp_path, redis_url, HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
    port = free_port()
    process = Process(
        [sys.executable, "manage.py", command, "--port", str(port), "--workers", "1"], env, tmp_path / "log"
    )
    process.start()
    try:
        ready = "/healthz" if command == "serve" else "/health"
        wait_until(lambda: _status(port, "GET", ready) == 200, timeout=30, what=f"{command} to answer")
        process.proc.send_signal(stop)
        assert process.proc.wait(timeout=15) == 0
    finally:
        process.stop()


def test_answers_on_a_kept_alive_connection_do_not_wait_for_delayed_acks(server):
    """With several workers uvicorn makes the listening socket, and asyncio then leaves Nagle's
    algorithm on for the connections: each answer (head and body written apart) waited ~40 ms
    for the client's delayed ACK."""
    connection = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=10)
    took = []
    for _ in range(30):
        started = time.perf_counter()
        connection.request("POST", "/api/v1/score", body=json.dumps({"model": MODEL, "token_ids": [1] * 64}))
        response = connection.getresponse()
        response.read()
        took.append(time.perf_counter() - started)
        assert response.status == 200
    connection.close()
    took.sort()
    assert took[len(took) // 2] < 0.02, f"median {took[len(took) // 2] * 1e3:.1f} ms"
