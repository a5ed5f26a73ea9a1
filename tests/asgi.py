"""A test client for the project's whole ASGI application (``kvsite.asgi``): the scoring fast path
and Django behind one router, as ``manage.py serve`` runs them.

Requests run through ``async_to_sync`` from the test's thread, so Django's sync code (and the fast
path's registry loads, which run ``thread_sensitive``) run in that thread and see the test's
transaction, as Django's own test client does. ``close_old_connections`` is kept off the request
signals meanwhile (it would close the test's connection), again as Django's client does.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

import httpx
from asgiref.sync import async_to_sync
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.test import Client


class AsgiResponse:
    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], content: bytes) -> None:
        self.status_code = status
        self.content = content
        self.headers = httpx.Headers(headers)  # case-insensitive, as HTTP headers are

    def json(self) -> Any:
        return jsonlib.loads(self.content)


class AsgiClient:
    """``post``/``get``/``put``/``patch``/``delete`` like Django's client: ``data`` (bytes, a str,
    or an object sent as JSON), ``content_type``, headers as ``HTTP_*`` keyword arguments (Host:
    ``testserver`` unless ``HTTP_HOST``) and the client's address as ``REMOTE_ADDR``."""

    def __init__(self, app: Any = None) -> None:
        if app is None:
            from kvsite.asgi import application

            app = application
        self.app = app
        self.defaults: dict[str, str] = {}
        self.cookies: dict[str, str] = {}

    def credentials(self, **headers: str) -> None:
        """Send these ``HTTP_*`` headers with every request."""
        self.defaults = dict(headers)

    def force_login(self, user: Any) -> None:
        """Log ``user`` in (a session cookie, as Django's client makes one)."""
        client = Client()
        client.force_login(user)
        self.cookies.update({name: morsel.value for name, morsel in client.cookies.items()})

    def request(
        self,
        method: str,
        path: str,
        data: Any = None,
        content_type: str = "application/json",
        query: Mapping[str, Any] | None = None,
        **headers: str,
    ) -> AsgiResponse:
        if data is None:
            body = b""
        elif isinstance(data, bytes):
            body = data
        elif isinstance(data, str):
            body = data.encode()
        else:
            body = jsonlib.dumps(data).encode()
        headers = {**self.defaults, **headers}
        remote = headers.pop("REMOTE_ADDR", "127.0.0.1")
        host = headers.pop("HTTP_HOST", "testserver")
        raw_headers = [(b"host", host.encode()), (b"content-length", str(len(body)).encode())]
        if body:
            raw_headers.append((b"content-type", content_type.encode()))
        for name, value in headers.items():
            if name.startswith("HTTP_"):
                raw_headers.append((name[5:].replace("_", "-").lower().encode(), value.encode()))
        if self.cookies:
            cookie = "; ".join(f"{k}={v}" for k, v in self.cookies.items())
            raw_headers.append((b"cookie", cookie.encode()))
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method.upper(),
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": urlencode(query or {}).encode(),
            "root_path": "",
            "headers": raw_headers,
            "client": (remote, 40000),
            "server": ("testserver", 80),
        }
        return self._send(scope, body)

    def post(
        self, path: str, data: Any = None, content_type: str = "application/json", **kw: str
    ) -> AsgiResponse:
        return self.request("POST", path, data, content_type, **kw)

    def get(self, path: str, data: Mapping[str, Any] | None = None, **kw: str) -> AsgiResponse:
        return self.request("GET", path, query=data, **kw)

    def put(
        self, path: str, data: Any = None, content_type: str = "application/json", **kw: str
    ) -> AsgiResponse:
        return self.request("PUT", path, data, content_type, **kw)

    def patch(
        self, path: str, data: Any = None, content_type: str = "application/json", **kw: str
    ) -> AsgiResponse:
        return self.request("PATCH", path, data, content_type, **kw)

    def delete(self, path: str, **kw: str) -> AsgiResponse:
        return self.request("DELETE", path, **kw)

    def _send(self, scope: dict, body: bytes) -> AsgiResponse:
        request_started.disconnect(close_old_connections)
        request_finished.disconnect(close_old_connections)
        try:
            return async_to_sync(self._call)(scope, body)
        finally:
            request_started.connect(close_old_connections)
            request_finished.connect(close_old_connections)

    async def _call(self, scope: dict, body: bytes) -> AsgiResponse:
        sent = False
        status, headers, chunks = 0, [], []

        async def receive() -> dict:
            nonlocal sent
            if sent:  # the client stays connected until the app has answered (Django listens)
                await asyncio.Event().wait()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status, headers = message["status"], list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        return AsgiResponse(status, headers, b"".join(chunks))
