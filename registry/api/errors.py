"""One error shape for every endpoint of the API: ``{"error": {"code", "message"}}``.

Validation errors add ``"fields"``: field name -> what is wrong with it. A view raises ``ApiError``
for an answer of its own; every other exception of a DRF view is answered in this shape by the
site's exception handler (``kvsite.drf``, which has the table of statuses and codes), and the
scoring fast path writes the same shape (``scoring.fastpath.errors``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rest_framework import exceptions, status


class ApiError(exceptions.APIException):
    """An error response in our shape: ``status``, a stable ``code`` and a message saying what
    to fix; ``fields`` (field -> messages) for validation errors."""

    def __init__(
        self, status_code: int, code: str, message: str, *, fields: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(detail=message, code=code)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.fields = fields


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
            "body_too_large",
            f"the request body is larger than {limit} bytes (KVCACHE_MAX_BODY_BYTES): send a shorter "
            "prompt, or token_ids for very long ones",
        )


def error_body(code: str, message: str, fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of an error response."""
    error: dict[str, Any] = {"code": code, "message": message}
    if fields:
        error["fields"] = dict(fields)
    return {"error": error}
