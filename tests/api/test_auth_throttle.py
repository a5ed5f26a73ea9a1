"""Password guessing over HTTP basic auth is cut short: after ``KVCACHE_AUTH_FAILURES`` failed
logins within the window, a client is answered 429 without its password being checked, whichever
web process it reaches, and whether or not Redis answers."""

from __future__ import annotations

import base64
import time

import pytest
import redis
from django.contrib.auth.hashers import MD5PasswordHasher

from registry.api.auth import FAILURE_KEY_PREFIX
from tests.servers import free_port

PATH = "/api/v1/hash-seed/"  # any staff endpoint: they share the authentication


class CountingHasher(MD5PasswordHasher):
    """MD5 (fast), counting the passwords it checks: a throttled attempt must check none."""

    checked = 0

    def verify(self, password: str, encoded: str) -> bool:
        CountingHasher.checked += 1
        return super().verify(password, encoded)


@pytest.fixture(autouse=True)
def throttle(settings, django_user_model, redis_url: str) -> None:
    """5 failures a minute, counted in a clean Redis; the staff user ops:ops-pw."""
    settings.REDIS_URL = redis_url
    settings.KVCACHE_AUTH_FAILURES = 5
    settings.KVCACHE_AUTH_FAILURE_WINDOW_SECONDS = 60
    settings.KVCACHE_TRUSTED_PROXIES = []
    settings.PASSWORD_HASHERS = ["tests.api.test_auth_throttle.CountingHasher"]
    django_user_model.objects.create_user("ops", password="ops-pw", is_staff=True)
    CountingHasher.checked = 0


def login(client, password: str, address: str, **headers: str):
    """One request to a staff endpoint as ops with ``password``, from ``address``."""
    credentials = base64.b64encode(f"ops:{password}".encode()).decode()
    return client.get(PATH, HTTP_AUTHORIZATION=f"Basic {credentials}", REMOTE_ADDR=address, **headers)


def fail(client, address: str, times: int, **headers: str) -> None:
    for _ in range(times):
        assert login(client, "guess", address, **headers).status_code == 401


def assert_locked_out(response, *, window: float) -> int:
    """The response is our 429; returns its Retry-After."""
    assert response.status_code == 429, response.content
    error = response.json()["error"]
    assert error["code"] == "too_many_attempts"
    retry_after = int(response.headers["Retry-After"])
    assert 1 <= retry_after <= window
    assert f"try again in {retry_after} s" in error["message"]
    return retry_after


def test_the_sixth_wrong_password_is_a_429_without_checking_it(client):
    fail(client, "203.0.113.1", 5)
    assert CountingHasher.checked == 5

    started = time.monotonic()
    response = login(client, "guess", "203.0.113.1")
    elapsed = time.monotonic() - started

    assert_locked_out(response, window=60)
    assert elapsed < 0.05
    assert_locked_out(login(client, "ops-pw", "203.0.113.1"), window=60)  # even the right one
    assert CountingHasher.checked == 5


def test_another_client_is_not_locked_out(client):
    fail(client, "203.0.113.1", 5)
    assert_locked_out(login(client, "guess", "203.0.113.1"), window=60)

    assert login(client, "ops-pw", "203.0.113.2").status_code == 200
    assert login(client, "guess", "203.0.113.2").status_code == 401
    assert_locked_out(login(client, "ops-pw", "203.0.113.1"), window=60)  # a success resets no one


def test_the_right_password_works_again_when_the_window_ends(client, settings):
    settings.KVCACHE_AUTH_FAILURE_WINDOW_SECONDS = 1
    fail(client, "203.0.113.1", 5)
    retry_after = assert_locked_out(login(client, "ops-pw", "203.0.113.1"), window=1)

    time.sleep(retry_after + 0.05)
    assert login(client, "ops-pw", "203.0.113.1").status_code == 200


def test_failures_seen_by_other_processes_count_here(client, redis_url):
    fail(client, "203.0.113.1", 2)
    shared = redis.Redis.from_url(redis_url)
    assert shared.get(FAILURE_KEY_PREFIX + "203.0.113.1") == b"2"
    assert 0 < shared.ttl(FAILURE_KEY_PREFIX + "203.0.113.1") <= 60

    shared.incrby(FAILURE_KEY_PREFIX + "203.0.113.1", 3)  # three failures on other replicas
    assert_locked_out(login(client, "ops-pw", "203.0.113.1"), window=60)
    assert CountingHasher.checked == 2


def test_without_redis_each_process_still_holds_the_limit(client, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

    started = time.monotonic()
    fail(client, "203.0.113.9", 5)
    assert_locked_out(login(client, "guess", "203.0.113.9"), window=60)
    assert time.monotonic() - started < 1.0
    assert login(client, "ops-pw", "203.0.113.10").status_code == 200
    assert CountingHasher.checked == 6


def test_x_forwarded_for_is_ignored_without_a_trusted_proxy(client):
    for n in range(5):  # a guesser inventing a new address for every attempt
        assert (
            login(client, "guess", "203.0.113.1", HTTP_X_FORWARDED_FOR=f"198.51.100.{n}").status_code == 401
        )

    assert_locked_out(login(client, "guess", "203.0.113.1", HTTP_X_FORWARDED_FOR="198.51.100.99"), window=60)


def test_behind_a_trusted_proxy_the_forwarded_client_is_counted(client, settings):
    settings.KVCACHE_TRUSTED_PROXIES = ["10.0.0.0/8"]
    # What the client wrote comes first; the proxy appends the address it saw.
    fail(client, "10.1.2.3", 5, HTTP_X_FORWARDED_FOR="1.2.3.4, 198.51.100.7")

    assert_locked_out(login(client, "ops-pw", "10.1.2.3", HTTP_X_FORWARDED_FOR="198.51.100.7"), window=60)
    assert login(client, "ops-pw", "10.1.2.3", HTTP_X_FORWARDED_FOR="198.51.100.8").status_code == 200
    assert (
        login(client, "ops-pw", "10.9.9.9", HTTP_X_FORWARDED_FOR="198.51.100.7, 10.1.2.3").status_code == 429
    )
