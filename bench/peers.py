"""The peer routers: vllm-router and SMG, what people put in front of a vLLM fleet instead of this
service, run as child processes in front of given pods.

``make bench-peers`` installs them, pinned in ``bench/peers-requirements.txt``, into a venv of
their own (``var/peers``): they bring dependencies of their own, which must not meet the
project's. Both are Rust routers behind a Python launcher; neither needs a GPU or the model hub.
SMG (the Shepherd Model Gateway, PyPI ``smg``) is what SGLang's router became; vllm-router 0.1.17
is a fork of its January version (sglang-router 0.3.2, the peer of older results), which SMG
replaces here: both install a console script named ``smg``, so they cannot share the venv.

    with start_peer("smg", workers=["http://127.0.0.1:8100", "http://127.0.0.1:8101"],
                    policy="cache_aware") as peer:
        httpx.post(f"{peer.url}/v1/completions", json={...})

In front of a prefill/decode (P/D) fleet, each in its P/D mode for vLLM's NixlConnector (the
prefill pod gets the prompt with ``kv_transfer_params: {"do_remote_decode": true, ...}`` and one
output token, unstreamed; its answer's ``kv_transfer_params`` go, with the client's request, to the
decode pod, whose answer is the client's, streamed if asked):

    with start_pd_peer("vllm-router", prefill=["http://127.0.0.1:8100"],
                       decode=["http://127.0.0.1:8101", "http://127.0.0.1:8102"],
                       policy="cache_aware") as peer:
        ...

or by hand, in the foreground until Ctrl-C:

    .venv/bin/python bench/peers.py smg --policy cache_aware \\
        --workers http://127.0.0.1:8100 http://127.0.0.1:8101 [--port 30000]
    .venv/bin/python bench/peers.py smg --policy cache_aware \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8101 http://127.0.0.1:8102

No Django here: the benchmarks import it as they import the simulator.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

__all__ = [
    "PEERS",
    "PEERS_VENV",
    "Peer",
    "PeerStartError",
    "PeersNotInstalled",
    "RunningPeer",
    "peers_installed",
    "start_pd_peer",
    "start_peer",
]

ROOT = Path(__file__).resolve().parents[1]
PEERS_VENV = ROOT / "var" / "peers"
"""Where ``make bench-peers`` installs the peers; its ``.installed`` stamp says the install finished."""

READY_TIMEOUT = 30.0
STOP_TIMEOUT = 5.0


NIXL_CONNECTOR = "NixlConnector"


@dataclass(frozen=True, slots=True)
class Peer:
    """How to run one peer router: its console script in the peers venv and the arguments before
    the common ones, the policies its ``--policy`` takes for a fleet of regular workers, its name
    for the warning log level, and the flags it needs beyond the common ones; for a P/D fleet, the
    flags of its P/D mode for vLLM's NixlConnector, and whether the pods go on its command line
    (``--prefill URL``, ``--decode URL``) or, once it serves, to its worker API
    (:func:`pd_worker_specs`)."""

    name: str
    command: tuple[str, ...]
    policies: tuple[str, ...]
    log_level: str
    extra: tuple[str, ...] = ()
    pd_mode: tuple[str, ...] = ()
    pd_workers_on_command_line: bool = True

    def _common(self, *, host: str, port: int, metrics_port: int) -> list[str]:
        return [
            "--host",
            host,
            "--port",
            str(port),
            # Both default to port 29000: two peers, or a peer and anything else there, would clash.
            "--prometheus-host",
            host,
            "--prometheus-port",
            str(metrics_port),
            "--log-level",
            self.log_level,
            *self.extra,
        ]

    def argv(
        self, venv: Path, *, workers: list[str], policy: str, host: str, port: int, metrics_port: int
    ) -> list[str]:
        """The command line that serves ``workers`` with ``policy`` on ``host:port``."""
        return [
            str(venv / "bin" / self.command[0]),
            *self.command[1:],
            "--worker-urls",
            *workers,
            "--policy",
            policy,
            *self._common(host=host, port=port, metrics_port=metrics_port),
        ]

    def pd_argv(
        self,
        venv: Path,
        *,
        prefill: list[str],
        decode: list[str],
        policy: str,
        prefill_policy: str | None = None,
        decode_policy: str | None = None,
        host: str,
        port: int,
        metrics_port: int,
    ) -> list[str]:
        """The command line of its P/D mode with ``policy`` for both sides unless
        ``prefill_policy`` or ``decode_policy`` says otherwise; the pods are on it only when
        :attr:`pd_workers_on_command_line` (no bootstrap port: that is SGLang's rendezvous)."""
        pods: list[str] = []
        if self.pd_workers_on_command_line:
            pods = [arg for url in prefill for arg in ("--prefill", url)]
            pods += [arg for url in decode for arg in ("--decode", url)]
        sides = [("--prefill-policy", prefill_policy), ("--decode-policy", decode_policy)]
        return [
            str(venv / "bin" / self.command[0]),
            *self.command[1:],
            *self.pd_mode,
            *pods,
            "--policy",
            policy,
            *(arg for flag, value in sides if value is not None for arg in (flag, value)),
            *self._common(host=host, port=port, metrics_port=metrics_port),
        ]


PEERS: dict[str, Peer] = {
    peer.name: peer
    for peer in (
        # kv_aware is left out: it needs each pod's KV event endpoint (--kv-event-source).
        Peer(
            name="vllm-router",
            command=("vllm-router",),
            policies=(
                "cache_aware",
                "round_robin",
                "power_of_two",
                "random",
                "consistent_hash",
                "sticky_least_loaded",
            ),
            log_level="warning",
            # Its vLLM P/D mode: sequential, NixlConnector's protocol (the default connector).
            # At startup it polls each pod's /health and reads /metrics, nothing else.
            pd_mode=("--vllm-pd-disaggregation", "--kv-connector", "nixl"),
        ),
        # SMG 1.13 over HTTP workers: it polls each pod's /health, reads /v1/models (owned_by
        # "vllm" makes it a vLLM worker) and, every 10 s whatever the policy, vLLM's /metrics for
        # load (running and waiting requests, KV cache usage); its cache_aware tree is over the
        # request text, so it loads no tokenizer. Left out: bucket (prefill workers only),
        # consistent_hashing and manual (they route on a session header the workloads do not
        # send), passthrough (one worker).
        # Its best other policy here is prefix_hash: a hash of the prompt's head (256 tokens, or
        # 1,024 characters of a request it does not tokenize) on a consistent-hash ring, walked
        # on while the home pod has 1.25x the mean load: consistent hashing with bounded loads.
        # Measured with bench/routing.py (30-s runs, docs/performance.md): on capacity at 9 QPS,
        # TTFT p90 4.7 s, tied with least_load (4.6-5.3 s), ahead of power_of_two (5.8-5.9 s),
        # with a 36% hit rate against their 3-7%; on hot at 16 QPS 5.2 s against power_of_two's
        # 9.3 s and least_load's 33.7 s (one run; SMG means least_load for gRPC workers: over
        # HTTP it cannot count a request's tokens). On hot at 8 QPS, where nothing queues, it was
        # the slower (2.0 s against 1.2 s): it keeps a hot group on its home pod longer.
        Peer(
            name="smg",
            command=("smg", "launch"),
            policies=("cache_aware", "power_of_two", "least_load", "prefix_hash", "round_robin", "random"),
            log_level="warn",
            # Its default waits up to 180 s for in-flight requests on SIGTERM.
            extra=("--shutdown-grace-period-secs", "1"),
            # Its HTTP P/D router serves a vLLM prefill pod (owned_by "vllm") in sequence, as
            # vLLM's proxy does, but adds do_remote_decode only for a pod whose kv_connector is
            # NixlConnector, which --prefill/--decode cannot say (nor does a pod's /v1/models):
            # without it the prefill gets one output token and no kv_transfer_params, so no KV is
            # handed off and the decode pod computes the whole prompt. The worker API takes it.
            pd_mode=("--pd-disaggregation",),
            pd_workers_on_command_line=False,
        ),
    )
}


class PeersNotInstalled(RuntimeError):
    """The peers venv is missing or incomplete."""


class PeerStartError(RuntimeError):
    """A peer exited, or did not serve every worker in time; the message has its log's tail."""


def pd_worker_specs(prefill: list[str], decode: list[str]) -> list[dict[str, str]]:
    """The pods of a P/D fleet as SMG's worker API (``POST /workers``) takes them: vLLM pods
    with vLLM's NixlConnector on each side (SMG pairs a prefill and a decode pod only when their
    connectors match)."""
    return [
        {"url": url, "worker_type": side, "runtime_type": "vllm", "kv_connector": NIXL_CONNECTOR}
        for side, urls in (("prefill", prefill), ("decode", decode))
        for url in urls
    ]


def peers_installed(venv: Path = PEERS_VENV) -> bool:
    """Whether ``make bench-peers`` has installed every peer into ``venv``."""
    return (venv / ".installed").is_file() and all(
        (venv / "bin" / peer.command[0]).is_file() for peer in PEERS.values()
    )


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass(eq=False)
class RunningPeer:
    """A started peer: where it serves, its process and its log (stdout and stderr; a temporary
    log goes when the peer stops). A context manager: leaving it stops the peer."""

    peer: Peer
    policy: str
    workers: list[str]
    url: str
    metrics_url: str
    argv: list[str]
    process: subprocess.Popen
    log_path: Path
    temporary_log: bool = False

    def __enter__(self) -> RunningPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.temporary_log:
            self.log_path.unlink(missing_ok=True)
        return self.process.returncode

    def log_tail(self, lines: int = 20) -> str:
        return _tail(self.log_path, lines)

    def check_running(self, deadline: float, ready_timeout: float) -> None:
        """Raise :class:`PeerStartError` if it has exited, or if it is past ``deadline``."""
        name = self.peer.name
        if self.process.poll() is not None:
            raise PeerStartError(
                f"{name} exited with status {self.process.returncode} before serving:\n{self.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise PeerStartError(
                f"{name} did not serve {len(self.workers)} healthy workers within {ready_timeout:g} s "
                f"(are the pods up?):\n{self.log_tail()}"
            )


def _serves_every_worker(client: httpx.Client, url: str, workers: list[str]) -> bool:
    """Both peers list their workers at ``GET /workers``. SMG answers ``/health`` before it has
    registered any (registration runs in the background), so only this says it can route."""
    try:
        response = client.get(f"{url}/workers")
        listed = response.json().get("workers", []) if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return False
    healthy = {w.get("url") for w in listed if w.get("is_healthy")}
    return healthy >= set(workers)


def _checked(name: str, policies: dict[str, str | None], workers: list[str], venv: Path) -> Peer:
    """The peer ``name``, once its policies, ``workers`` and its install are checked."""
    peer = PEERS.get(name)
    if peer is None:
        raise ValueError(f"unknown peer {name!r}: choose one of {', '.join(PEERS)}")
    for what, policy in policies.items():
        if policy is not None and policy not in peer.policies:
            raise ValueError(f"{name} has no {what} {policy!r}: choose one of {', '.join(peer.policies)}")
    if not workers:
        raise ValueError("give at least one worker URL")
    if not peers_installed(venv):
        raise PeersNotInstalled(f"the peer routers are not installed in {venv}: run `make bench-peers`")
    return peer


def start_peer(
    name: str,
    *,
    workers: list[str],
    policy: str,
    host: str = "127.0.0.1",
    port: int = 0,
    venv: Path = PEERS_VENV,
    log_path: Path | None = None,
    ready_timeout: float = READY_TIMEOUT,
) -> RunningPeer:
    """Start peer ``name`` in front of ``workers`` (base URLs) with ``policy`` on ``host:port``
    (0: a free port) and return once it serves every worker healthy. Raises
    :class:`PeersNotInstalled` without the peers venv, ``ValueError`` for an unknown peer or
    policy, :class:`PeerStartError` when it exits or is not ready within ``ready_timeout``
    seconds (it is stopped then). Its output goes to ``log_path`` (default: a temporary file,
    removed when it stops)."""
    peer = _checked(name, {"policy": policy}, workers, venv)
    workers = [w.rstrip("/") for w in workers]
    port, metrics_port = port or _free_port(host), _free_port(host)
    argv = peer.argv(venv, workers=workers, policy=policy, host=host, port=port, metrics_port=metrics_port)
    return _launch(
        peer,
        argv,
        policy=policy,
        workers=workers,
        host=host,
        port=port,
        metrics_port=metrics_port,
        log_path=log_path,
        ready_timeout=ready_timeout,
    )


def start_pd_peer(
    name: str,
    *,
    prefill: list[str],
    decode: list[str],
    policy: str,
    prefill_policy: str | None = None,
    decode_policy: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    venv: Path = PEERS_VENV,
    log_path: Path | None = None,
    ready_timeout: float = READY_TIMEOUT,
) -> RunningPeer:
    """Start peer ``name`` in its P/D mode for vLLM's NixlConnector in front of the ``prefill``
    and ``decode`` pods (base URLs), with ``policy`` on both sides unless ``prefill_policy`` or
    ``decode_policy`` says otherwise, as :func:`start_peer` starts a peer (the same errors; it
    also needs a pod on each side). Every request is served in two steps: the prefill pod's
    (one output token, ``kv_transfer_params.do_remote_decode``, unstreamed), then the decode
    pod's, with the ``kv_transfer_params`` the prefill pod answered."""
    if not prefill or not decode:
        raise ValueError("a P/D fleet needs at least one prefill pod and one decode pod")
    policies = {"policy": policy, "prefill policy": prefill_policy, "decode policy": decode_policy}
    peer = _checked(name, policies, prefill + decode, venv)
    prefill, decode = [w.rstrip("/") for w in prefill], [w.rstrip("/") for w in decode]
    port, metrics_port = port or _free_port(host), _free_port(host)
    argv = peer.pd_argv(
        venv,
        prefill=prefill,
        decode=decode,
        policy=policy,
        prefill_policy=prefill_policy,
        decode_policy=decode_policy,
        host=host,
        port=port,
        metrics_port=metrics_port,
    )
    register = [] if peer.pd_workers_on_command_line else pd_worker_specs(prefill, decode)
    return _launch(
        peer,
        argv,
        policy=policy,
        workers=prefill + decode,
        host=host,
        port=port,
        metrics_port=metrics_port,
        log_path=log_path,
        ready_timeout=ready_timeout,
        register=register,
    )


def _register(client: httpx.Client, url: str, specs: list[dict[str, str]]) -> bool:
    """``POST /workers`` each of ``specs``; False while the peer does not answer yet."""
    try:
        client.get(f"{url}/health")
    except httpx.HTTPError:
        return False
    for spec in specs:
        try:
            response = client.post(f"{url}/workers", json=spec)
        except httpx.HTTPError as error:
            raise PeerStartError(f"registering {spec['url']}: {error}") from error
        if response.status_code >= 300:
            raise PeerStartError(f"registering {spec['url']}: {response.status_code} {response.text}")
    return True


def _launch(
    peer: Peer,
    argv: list[str],
    *,
    policy: str,
    workers: list[str],
    host: str,
    port: int,
    metrics_port: int,
    log_path: Path | None,
    ready_timeout: float,
    register: list[dict[str, str]] | None = None,
) -> RunningPeer:
    """Run ``argv``, ``register`` those workers once it answers, and wait until it serves every
    one of ``workers`` healthy."""
    temporary_log = log_path is None
    if log_path is None:
        fd, path = tempfile.mkstemp(prefix=f"{peer.name}-{policy}-", suffix=".log")
        os.close(fd)
        log_path = Path(path)
    # The peers' HTTP clients honour proxy variables: the pods must be reached directly.
    pod_hosts = [urlsplit(w).hostname or "" for w in workers]
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), *pod_hosts]))
    env = {**os.environ, "NO_PROXY": no_proxy, "no_proxy": no_proxy}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    url_host = f"[{host}]" if ":" in host else host
    running = RunningPeer(
        peer=peer,
        policy=policy,
        workers=workers,
        url=f"http://{url_host}:{port}",
        metrics_url=f"http://{url_host}:{metrics_port}/metrics",
        argv=argv,
        process=process,
        log_path=log_path,
        temporary_log=temporary_log,
    )
    deadline = time.monotonic() + ready_timeout
    unregistered = register or []
    try:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while unregistered and not _register(client, running.url, unregistered):
                running.check_running(deadline, ready_timeout)
                time.sleep(0.05)
            while not _serves_every_worker(client, running.url, workers):
                running.check_running(deadline, ready_timeout)
                time.sleep(0.05)
    except BaseException:
        running.stop()
        raise
    return running


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a peer router in front of pods until Ctrl-C.")
    parser.add_argument("peer", choices=sorted(PEERS))
    pods = parser.add_mutually_exclusive_group(required=True)
    pods.add_argument("--workers", nargs="+", help="pod base URLs")
    pods.add_argument("--prefill", nargs="+", help="P/D mode: the prefill pods' base URLs (with --decode)")
    parser.add_argument("--decode", nargs="+", default=[], help="P/D mode: the decode pods' base URLs")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    args = parser.parse_args(argv)
    if bool(args.prefill) != bool(args.decode):
        parser.error("--prefill and --decode go together")
    where = {"policy": args.policy, "host": args.host, "port": args.port}
    try:
        if args.prefill:
            peer = start_pd_peer(args.peer, prefill=args.prefill, decode=args.decode, **where)
        else:
            peer = start_peer(args.peer, workers=args.workers, **where)
    except (PeersNotInstalled, PeerStartError, ValueError) as error:
        print(error, file=sys.stderr)
        return 1
    print(f"{args.peer} ({args.policy}) at {peer.url}, log {peer.log_path}\n  {' '.join(peer.argv)}")
    with peer, contextlib.suppress(KeyboardInterrupt):
        peer.process.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
