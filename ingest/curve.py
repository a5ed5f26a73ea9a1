"""CURVE on the KV-event sockets: ZeroMQ's own encryption and key authentication (ZMTP CURVE,
RFC 26), set up for ``manage.py ingest`` (and the simulator's publishers).

Keys are ZeroMQ certificates as ``zmq.auth.create_certificates`` writes them (``manage.py
curve_keys``): ``NAME.key`` holds a public key, ``NAME.key_secret`` the pair.

* **Sockets ingest binds** (``--bind``: the engines connect to it): ingest is the CURVE server,
  with its own key pair. A ZAP handler (``zmq.auth``'s ``ThreadAuthenticator``, started on the
  receiver's context *before* anything binds) admits exactly the client keys of a directory of
  public certificates, read once at start. The sockets enforce the ZAP domain, so a socket whose
  handler is missing admits no one rather than everyone. A publisher without CURVE, with another
  key, or that takes ingest for another server fails the handshake: libzmq never hands its
  messages to the socket (nothing of it is decoded). libzmq 4.3 does not retry a connection
  refused for its key: a publisher whose key is listed later must reconnect (restart it).
* **Sockets ingest connects** (``--connect``, the replicas' event endpoints, the replay DEALER):
  ingest is the CURVE client of the engines' bound PUB and ROUTER, which share one key pair
  whose public key ingest is given (``server_key``).

Refused handshakes are logged (rate-limited, through a socket monitor; an unknown key by the ZAP
handler with the key), never raised: a stranger cannot stop the receiver.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from ingest.ratelimit import RateLimitedLog

__all__ = [
    "ZAP_DOMAIN",
    "CurveError",
    "EventCurve",
    "KeyPair",
    "load_allowed_keys",
    "load_key_pair",
    "load_public_key",
]

log = logging.getLogger(__name__)
REFUSED_LOG = RateLimitedLog(log)

ZAP_DOMAIN = "kvcache-ingest"
"""The ZAP domain of ingest's CURVE server sockets (the handler answers for it alone)."""

_Z85_KEY_CHARS = 40


class CurveError(ValueError):
    """A key file or directory that cannot be used, or settings that do not fit the endpoints;
    the message says which and why."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A CURVE key pair, both keys Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never the secret key in a log line or a traceback
        return f"KeyPair(public={self.public.decode()!r})"


def _valid_key(key: bytes | None) -> bool:
    if key is None or len(key) != _Z85_KEY_CHARS:
        return False
    try:
        return len(z85.decode(key)) == 32
    except Exception:  # z85 raises what its table lookup or struct packing meets
        return False


def _read_certificate(path: Path, what: str) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CurveError(f"{what}: {path} is not a file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise CurveError(f"{what}: {path} is not a ZeroMQ certificate ({e})") from None
    if not _valid_key(public):
        raise CurveError(f"{what}: the public-key of {path} is not a 40-character Z85 CURVE key")
    return public, secret


def load_key_pair(path: str | os.PathLike, *, what: str = "the key pair") -> KeyPair:
    """The key pair of a secret certificate (``NAME.key_secret``); ``CurveError`` when it is
    missing, not a certificate, holds no secret key, or its keys are malformed or no pair."""
    path = Path(path)
    public, secret = _read_certificate(path, what)
    if secret is None:
        raise CurveError(f"{what}: {path} holds no secret-key (give the NAME.key_secret certificate)")
    if not _valid_key(secret):
        raise CurveError(f"{what}: the secret-key of {path} is not a 40-character Z85 CURVE key")
    if zmq.curve_public(secret) != public:
        raise CurveError(f"{what}: the public-key of {path} is not its secret-key's")
    return KeyPair(public, secret)


def load_public_key(path: str | os.PathLike, *, what: str = "the public key") -> bytes:
    """The public key of a certificate (``NAME.key``, or the pair's ``NAME.key_secret``)."""
    return _read_certificate(Path(path), what)[0]


def load_allowed_keys(directory: str | os.PathLike, *, what: str = "the allowed keys") -> frozenset[bytes]:
    """The public keys of every ``*.key`` certificate in ``directory`` (what
    ``zmq.auth.load_certificates`` reads); ``CurveError`` when it is no directory, holds no
    certificate, or one of them is malformed (named)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CurveError(f"{what}: {directory} is not a directory")
    files = sorted(directory.glob("*.key"))
    if not files:
        raise CurveError(f"{what}: {directory} holds no public certificate (NAME.key): no one could connect")
    return frozenset(_read_certificate(path, what)[0] for path in files)


@dataclass(frozen=True, slots=True)
class EventCurve:
    """CURVE for the KV-event sockets of one process: its own ``keys``; as a server, the
    ``allowed`` client keys (Z85); as a client, the ``server_key`` of the sockets it connects to
    (None: it connects to none with CURVE). Plain values: a worker process gets a copy."""

    keys: KeyPair
    allowed: frozenset[bytes] = frozenset()
    server_key: bytes | None = None

    def secure(self, sock: zmq.Socket, *, server: bool, watch: bool = True) -> None:
        """Make ``sock`` (before it binds or connects) a CURVE server admitting the ``allowed``
        keys through the ZAP handler of its context (``start_authenticator``), or a CURVE client
        of ``server_key``. ``watch``: log its failed handshakes (a thread per socket: not for
        short-lived ones)."""
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret
        if server:
            if not self.allowed:
                raise ValueError("a CURVE server socket needs the allowed client keys")
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no handler: no one, rather than anyone
        else:
            if self.server_key is None:
                raise ValueError("a CURVE client socket needs the server's public key")
            sock.curve_serverkey = self.server_key
        if watch:
            _watch_handshakes(sock, server=server)

    def start_authenticator(self, context: zmq.Context) -> ThreadAuthenticator:
        """The ZAP handler of ``context`` (one per context), started: it admits the ``allowed``
        keys on ``ZAP_DOMAIN``. Start it before a server socket binds; stop it after they closed."""
        authenticator = ThreadAuthenticator(context, log=log)
        authenticator.start()
        authenticator.configure_curve_callback(ZAP_DOMAIN, _AllowedKeys(self.allowed))
        return authenticator


class _AllowedKeys:
    """The ZAP handler's answer for a client key: listed or not (a refusal is logged)."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        REFUSED_LOG.warning(
            "unknown_key",
            "refused a KV-event publisher: its CURVE public key %s is not among the allowed keys",
            key.decode(errors="replace"),
        )
        return False


_WHY = {
    (True, "no_curve"): "the peer does not speak CURVE (a publisher without CURVE?)",
    (True, "broke_off"): "the peer broke the handshake off (a publisher without CURVE?)",
    (True, "wrong_key"): "it does not decrypt (the peer has another public key for this server)",
    (False, "no_curve"): "the server does not speak CURVE",
    (False, "broke_off"): "the server broke the handshake off (it does not speak CURVE?)",
    (False, "wrong_key"): "it does not decrypt (the wrong public key for the server?)",
    (False, "not_allowed"): "the server does not admit this socket's public key",
}


def _failure(event: int, value: int) -> str | None:
    """The reason of a failed handshake from a monitor event (None: not a failure)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "broke_off"
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "not_allowed"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "no_curve"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "wrong_key"
        return "protocol"
    return None


def _watch_handshakes(sock: zmq.Socket, *, server: bool) -> None:
    """Log ``sock``'s failed CURVE handshakes, from a thread that ends when the socket closes.
    (A server's unknown key is logged by the ZAP handler, with the key.)"""
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_MONITOR_STOPPED
    )
    side = "server" if server else "client"

    def watch() -> None:
        try:
            while True:
                message = recv_monitor_message(monitor)
                if message["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                reason = _failure(message["event"], message["value"])
                if reason is None or (server and reason == "not_allowed"):
                    continue
                why = (
                    _WHY.get((server, reason))
                    or f"a malformed handshake (ZeroMQ's error {message['value']:#x})"
                )
                REFUSED_LOG.warning(
                    f"{side}_{reason}",
                    "a CURVE handshake %s %s failed: %s",
                    "on" if server else "with",
                    message["endpoint"].decode(errors="replace"),
                    why,
                )
        except zmq.ZMQError:  # the context is terminating
            return
        finally:
            monitor.close(0)

    threading.Thread(target=watch, name="ingest-curve-monitor", daemon=True).start()
