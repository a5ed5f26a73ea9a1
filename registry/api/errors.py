"""One error shape for every endpoint of the API: ``{"error": {"code", "message"}}``.

Validation errors add ``"fields"``: field name -> what is wrong with it. The mapping from the
core's exceptions to HTTP statuses lives here and nowhere else:

========================  ======  ==============================================================
exception                 status  code
========================  ======  ==============================================================
ValidationError           400     ``invalid_request`` (DRF's and Django's; ``fields`` added)
ParseError                400     ``invalid_json``
NotAuthenticated          401     ``unauthenticated`` (403 ``forbidden`` where no challenge fits)
PermissionDenied          403     ``forbidden``
NotFound, Http404         404     ``not_found``
MethodNotAllowed          405     ``method_not_allowed``
BodyTooLarge              413     ``body_too_large``
UnsupportedMediaType      415     ``unsupported_media_type``
the core's exceptions       as ``scoring.fastpath.errors`` answers them (one table for both)
anything else             500     ``internal_error`` (logged with its traceback)
========================  ======  ==============================================================
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import set_rollback

from scoring.fastpath.errors import from_core

logger = logging.getLogger(__name__)


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


def exception_handler(exc: Exception, context: Mapping[str, Any]) -> Response:
    """DRF's ``EXCEPTION_HANDLER``: every exception becomes a response in our shape."""
    error = to_api_error(exc, context.get("view"))
    if error.status_code >= 500 and error.status_code != status.HTTP_503_SERVICE_UNAVAILABLE:
        logger.error("unhandled error in %s", type(context.get("view")).__name__, exc_info=exc)
    headers = {}
    if getattr(exc, "auth_header", None):
        headers["WWW-Authenticate"] = exc.auth_header
    set_rollback()
    return Response(
        error_body(error.code, error.message, error.fields), status=error.status_code, headers=headers
    )


def to_api_error(exc: Exception, view: object = None) -> ApiError:
    """The ``ApiError`` an exception is answered with (see the module's table)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, exceptions.ValidationError):
        return _validation_error(exc.detail)
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        return _validation_error(detail)
    core = from_core(exc)
    if core is not None:
        if core.code == "invalid_request":
            return _validation_error(core.fields or {})
        return ApiError(core.status, core.code, core.message)
    if isinstance(exc, exceptions.ParseError):
        return ApiError(400, "invalid_json", str(exc.detail))
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        if exc.status_code == status.HTTP_403_FORBIDDEN:
            return ApiError(403, "forbidden", str(exc.detail))
        message = str(exc.detail)
        if isinstance(exc, exceptions.NotAuthenticated):
            message = getattr(view, "auth_hint", "") or message
        return ApiError(401, "unauthenticated", message)
    if isinstance(exc, exceptions.PermissionDenied | DjangoPermissionDenied):
        message = str(exc.detail) if isinstance(exc, exceptions.APIException) else "permission denied"
        return ApiError(403, "forbidden", message)
    if isinstance(exc, exceptions.NotFound | Http404):
        return ApiError(404, "not_found", str(exc) or "not found")
    if isinstance(exc, exceptions.MethodNotAllowed):
        return ApiError(405, "method_not_allowed", str(exc.detail))
    if isinstance(exc, exceptions.UnsupportedMediaType):
        return ApiError(415, "unsupported_media_type", f"{exc.detail} Send a JSON body (application/json).")
    if isinstance(exc, exceptions.APIException):
        return ApiError(exc.status_code, str(exc.get_codes()), str(exc.detail))
    return ApiError(500, "internal_error", "internal error (logged on the server)")


def _validation_error(detail: Any) -> ApiError:
    fields = _plain(detail) if isinstance(detail, Mapping) else {"non_field_errors": _plain(detail)}
    return ApiError(400, "invalid_request", _summary(fields), fields=fields)


def _plain(detail: Any) -> Any:
    """DRF's ErrorDetail tree as plain strings, lists and dicts."""
    if isinstance(detail, Mapping):
        return {str(key): _plain(value) for key, value in detail.items()}
    if isinstance(detail, list | tuple):
        return [_plain(item) for item in detail]
    return str(detail)


def _summary(fields: Mapping[str, Any]) -> str:
    """One line naming every field that is wrong and why: ``"prompt: may not be empty; ..."``."""
    parts = []
    for name, problems in fields.items():
        for path, message in _flatten(problems):
            where = name + path
            parts.append(message if where == "non_field_errors" else f"{where}: {message}")
    return "; ".join(parts) or "invalid request"


def _flatten(problems: Any, path: str = "") -> list[tuple[str, str]]:
    if isinstance(problems, Mapping):
        out = []
        for key, value in problems.items():
            sub = f"[{key}]" if str(key).isdigit() else f".{key}"
            out += _flatten(value, path + sub)
        return out
    if isinstance(problems, list):
        return [item for problem in problems for item in _flatten(problem, path)]
    return [(path, str(problems))]
