"""Who may call what.

* Scoring endpoints: the fast path checks their API keys (``scoring.fastpath.app``).
* Registry endpoints (pods, model configs, hash seed): a staff user, logged in through a session
  or HTTP basic auth, always (401 when not logged in, 403 when not staff).
* Failed HTTP basic logins are counted per client address: after ``KVCACHE_AUTH_FAILURES`` of
  them within ``KVCACHE_AUTH_FAILURE_WINDOW_SECONDS`` the client is answered 429
  ``too_many_attempts`` (with ``Retry-After``) until its window ends, without the password hasher
  running (each check costs ~0.3 s of CPU: unthrottled guessing starves the scoring endpoints).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import OrderedDict

import redis
from django.conf import settings
from redis.backoff import NoBackoff
from redis.retry import Retry
from rest_framework import exceptions
from rest_framework.authentication import (
    BasicAuthentication,
    SessionAuthentication,
    get_authorization_header,
)
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import IsAdminUser
from rest_framework.request import Request

from stack.trust import TrustedProxies

logger = logging.getLogger(__name__)

STAFF_HINT = "this endpoint is for staff users: log in (session) or send HTTP basic credentials"

# --- throttled HTTP basic auth ------------------------------------------------------------------

FAILURE_STORE_TIMEOUT_SECONDS = 0.2
"""Longest a login waits on Redis for the failure counters before counting in this process."""
FAILURE_STORE_RETRY_SECONDS = 5.0
"""After Redis failed to answer, how long the failure counters stay in this process before
Redis is tried again (so an unreachable Redis costs one timeout per interval, not per login)."""
LOCAL_FAILURE_CLIENTS = 10_000
"""Most clients the in-process fallback table remembers; the oldest window is dropped first."""
FAILURE_KEY_PREFIX = "kv:auth:failures:"

# One failure: count it, and start the client's window with its first failure. Atomic, so that
# every web process and replica shares one count and no counter is left without its expiry.
_RECORD_FAILURE = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return n
"""


class TooManyAttempts(exceptions.Throttled):
    """429 ``too_many_attempts``: the client failed to log in too often; ``wait`` is how many
    seconds until it may try again. The site's exception handler (``kvsite.drf``) answers it with
    its status and code."""

    default_detail = "too many failed logins from this address:"
    default_code = "too_many_attempts"
    extra_detail_singular = extra_detail_plural = "try again in {wait} s"


def client_address(request: Request) -> str:
    """The address login failures are counted against: ``REMOTE_ADDR``; when that is one of
    ``KVCACHE_TRUSTED_PROXIES``, the right-most ``X-Forwarded-For`` address that is not (the
    left-most when every hop is trusted). The header is ignored when no proxy is trusted, since a
    client can write anything in it (``stack.trust.TrustedProxies``)."""
    proxies = _trusted_proxies(tuple(settings.KVCACHE_TRUSTED_PROXIES))
    return proxies.client(request.META.get("REMOTE_ADDR", ""), request.META.get("HTTP_X_FORWARDED_FOR", ""))


@functools.lru_cache(maxsize=8)
def _trusted_proxies(entries: tuple[str, ...]) -> TrustedProxies:
    return TrustedProxies(entries)


class _LocalFailures:
    """Failures per client in this process, for when Redis cannot be reached: at most
    ``capacity`` clients, the one whose window started first dropped first."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._windows: OrderedDict[str, tuple[int, float]] = OrderedDict()  # client -> (count, ends at)

    def count(self, client: str) -> tuple[int, float]:
        """The client's failures in its current window and the seconds left in it."""
        with self._lock:
            count, ends_at = self._windows.get(client, (0, 0.0))
        left = ends_at - time.monotonic()
        return (count, left) if left > 0 else (0, 0.0)

    def add(self, client: str, *, window: float) -> None:
        now = time.monotonic()
        with self._lock:
            count, ends_at = self._windows.get(client, (0, 0.0))
            if ends_at > now:
                self._windows[client] = (count + 1, ends_at)
                return
            self._windows.pop(client, None)
            self._windows[client] = (1, now + window)  # a new window goes to the young end
            while len(self._windows) > self._capacity:
                self._windows.popitem(last=False)


_local_failures = _LocalFailures(LOCAL_FAILURE_CLIENTS)


class FailureCounter:
    """Failed logins per client, in the Redis at one URL (shared by every web process and
    replica), or in this process's bounded table while that Redis does not answer."""

    def __init__(self, url: str) -> None:
        self._redis = redis.Redis.from_url(
            url,
            socket_connect_timeout=FAILURE_STORE_TIMEOUT_SECONDS,
            socket_timeout=FAILURE_STORE_TIMEOUT_SECONDS,
            retry=Retry(NoBackoff(), 0),
        )
        self._record = self._redis.register_script(_RECORD_FAILURE)
        self._redis_down_until = 0.0

    def seconds_locked(self, client: str, *, limit: int) -> float:
        """Seconds until ``client`` may try a password again; 0 while it has had fewer than
        ``limit`` failures in its current window."""
        key = FAILURE_KEY_PREFIX + client
        if self._redis_answers():
            try:
                pipe = self._redis.pipeline(transaction=False)
                count, left_ms = pipe.get(key).pttl(key).execute()
            except redis.RedisError as error:
                self._redis_failed(error)
            else:
                if count is None or int(count) < limit:
                    return 0.0
                # An expiry always comes with the count (see _RECORD_FAILURE); none: a second.
                return left_ms / 1000 if left_ms > 0 else 1.0
        count, left = _local_failures.count(client)
        return left if count >= limit else 0.0

    def add_failure(self, client: str, *, window: float) -> None:
        """Count one failure of ``client``; its first failure starts a window of ``window`` s."""
        if self._redis_answers():
            try:
                self._record(keys=[FAILURE_KEY_PREFIX + client], args=[max(1, int(window * 1000))])
                return
            except redis.RedisError as error:
                self._redis_failed(error)
        _local_failures.add(client, window=window)

    def _redis_answers(self) -> bool:
        return time.monotonic() >= self._redis_down_until

    def _redis_failed(self, error: redis.RedisError) -> None:
        self._redis_down_until = time.monotonic() + FAILURE_STORE_RETRY_SECONDS
        logger.warning(
            "login failure counters: Redis does not answer (%s); counting in this process for %.0f s",
            error,
            FAILURE_STORE_RETRY_SECONDS,
        )


_failure_counters: dict[str, FailureCounter] = {}
_failure_counters_lock = threading.Lock()


def failure_counter() -> FailureCounter:
    """One counter per ``REDIS_URL`` (its client holds a pool shared by every request)."""
    url = settings.REDIS_URL
    counter = _failure_counters.get(url)
    if counter is None:
        with _failure_counters_lock:
            counter = _failure_counters.get(url)
            if counter is None:
                counter = _failure_counters[url] = FailureCounter(url)
    return counter


class ThrottledBasicAuthentication(BasicAuthentication):
    """HTTP basic auth that stops checking passwords for a client (``client_address``) after
    ``KVCACHE_AUTH_FAILURES`` failed attempts within ``KVCACHE_AUTH_FAILURE_WINDOW_SECONDS`` of
    its first one: until that window ends it is answered 429 without the hasher running. Each
    client has its own count; a successful login resets none (so one known password cannot be
    used to keep guessing another). Concurrent attempts of one client that all pass the check
    before any failure is counted can exceed the limit by their number, once per window."""

    def authenticate(self, request: Request) -> tuple[object, None] | None:
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != b"basic":
            return None  # what BasicAuthentication does: not ours to count
        client = client_address(request)
        counter = failure_counter()
        locked = counter.seconds_locked(client, limit=settings.KVCACHE_AUTH_FAILURES)
        if locked > 0:
            wait = max(1, math.ceil(locked))
            _set_response_header(request, "Retry-After", str(wait))
            raise TooManyAttempts(wait)
        try:
            return super().authenticate(request)
        except AuthenticationFailed:
            counter.add_failure(client, window=settings.KVCACHE_AUTH_FAILURE_WINDOW_SECONDS)
            raise


def _set_response_header(request: Request, name: str, value: str) -> None:
    """Put a header on the response DRF will send: the error handler adds only
    ``WWW-Authenticate``, but DRF copies its view's ``headers`` onto every response it finalizes,
    error responses included."""
    view = (request.parser_context or {}).get("view")
    headers = getattr(view, "headers", None)
    if isinstance(headers, dict):
        headers[name] = value


# Basic first: its challenge makes an anonymous request a 401 (a session-only view would say 403).
STAFF_AUTHENTICATION = [ThrottledBasicAuthentication, SessionAuthentication]
STAFF_PERMISSIONS = [IsAdminUser]
