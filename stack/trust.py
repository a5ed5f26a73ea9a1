"""Whom our servers trust, and how far: API keys and reverse proxies. Django-free: the scoring fast
path, the registry API's login throttle, the gateway and the servers' per-client connection limit
(``stack.asgi_server``) share it.

* **API keys** (``KVCACHE_API_KEYS``): a request passes with ``Authorization: Bearer <one of
  them>``, compared in constant time against every key; with no keys, every request passes.
* **Trusted proxies** (``KVCACHE_TRUSTED_PROXIES``): addresses or networks whose
  ``X-Forwarded-For`` is believed. From anyone else the header says nothing: a client can write
  anything in it.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

BEARER_HINT = "this endpoint needs an API key: send the header 'Authorization: Bearer <key>'"


def bearer_problem(header: bytes | None, keys: tuple[str, ...]) -> str | None:
    """``None`` when a request with this ``Authorization`` header may pass (always when there are
    no ``keys``); else what is wrong with it, for a 401."""
    if not keys:
        return None
    if not header:
        return BEARER_HINT
    scheme, _, token = header.strip().partition(b" ")
    token = token.strip()
    if scheme.lower() != b"bearer" or not token:
        return f"malformed Authorization header: {BEARER_HINT}"
    # Every key is compared, in constant time: timing says nothing about which one matched.
    matched = [hmac.compare_digest(token, key.encode()) for key in keys]
    return None if any(matched) else "the API key is not valid"


class TrustedProxies:
    """Reverse proxies, by address or network (``10.0.0.0/8``); empty: none is trusted."""

    MEMO_SIZE = 4096
    """Addresses whose answer is remembered (the memo is emptied when full)."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        self.networks = tuple(ipaddress.ip_network(entry.strip(), strict=False) for entry in entries)
        self._memo: dict[str, bool] = {}

    def __bool__(self) -> bool:
        return bool(self.networks)

    def trusts(self, address: str) -> bool:
        """Whether ``address`` (an IP address as text; anything else is not trusted) is one of them."""
        if not self.networks:
            return False
        known = self._memo.get(address)
        if known is None:
            if len(self._memo) >= self.MEMO_SIZE:
                self._memo.clear()
            known = self._memo[address] = self._contains(address)
        return known

    def _contains(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.networks)

    def client(self, remote: str, forwarded_for: str) -> str:
        """The client behind a connection from ``remote`` whose ``X-Forwarded-For`` says
        ``forwarded_for``: ``remote`` itself unless it is trusted; else the right-most forwarded
        address that is not trusted (the left-most when every hop is)."""
        if not self.trusts(remote):
            return remote
        hops = [hop.strip() for hop in forwarded_for.split(",") if hop.strip()]
        for hop in reversed(hops):
            if not self.trusts(hop):
                return hop
        return hops[0] if hops else remote
