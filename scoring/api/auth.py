"""Who may call what.

* Scoring endpoints: open when ``KVCACHE_API_KEYS`` is empty (as upstream); otherwise they need
  ``Authorization: Bearer <key>`` with one of the keys (401 without it).
* Registry endpoints (pods, model configs, hash seed): a staff user, logged in through a session
  or HTTP basic auth, always (401 when not logged in, 403 when not staff).
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, BasicAuthentication, SessionAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import BasePermission, IsAdminUser
from rest_framework.request import Request

BEARER_HINT = "this endpoint needs an API key: send the header 'Authorization: Bearer <key>'"
STAFF_HINT = "this endpoint is for staff users: log in (session) or send HTTP basic credentials"


class ApiKey(str):
    """The API key a request authenticated with (``request.auth``)."""


class ApiKeyAuthentication(BaseAuthentication):
    """``Authorization: Bearer <key>`` against ``KVCACHE_API_KEYS``. Does nothing when no keys
    are configured; a request without the header is left to ``ApiKeyRequired``."""

    def authenticate(self, request: Request) -> tuple[AnonymousUser, ApiKey] | None:
        keys = settings.KVCACHE_API_KEYS
        if not keys:
            return None
        header = request.META.get("HTTP_AUTHORIZATION", "")
        if not header:
            return None
        scheme, _, token = header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationFailed(f"malformed Authorization header: {BEARER_HINT}")
        given = token.encode()
        # Compare against every key in constant time, so timing says nothing about which matched.
        matched = [hmac.compare_digest(given, key.encode()) for key in keys]
        if not any(matched):
            raise AuthenticationFailed("the API key is not valid")
        return AnonymousUser(), ApiKey(token)

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="kvcache"'


class ApiKeyScheme(OpenApiAuthenticationExtension):
    """Documents ``ApiKeyAuthentication`` in the OpenAPI schema as HTTP bearer auth."""

    target_class = ApiKeyAuthentication
    name = "apiKey"

    def get_security_definition(self, auto_schema: object) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "Required only when KVCACHE_API_KEYS is set: one of its keys.",
        }


class ApiKeyRequired(BasePermission):
    """Lets a request through when no API keys are configured or it authenticated with one."""

    message = BEARER_HINT

    def has_permission(self, request: Request, view: object) -> bool:
        return not settings.KVCACHE_API_KEYS or isinstance(request.auth, ApiKey)


SCORING_AUTHENTICATION = [ApiKeyAuthentication]
SCORING_PERMISSIONS = [ApiKeyRequired]
# Basic first: its challenge makes an anonymous request a 401 (a session-only view would say 403).
STAFF_AUTHENTICATION = [BasicAuthentication, SessionAuthentication]
STAFF_PERMISSIONS = [IsAdminUser]
