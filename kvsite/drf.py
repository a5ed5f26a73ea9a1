"""The DRF API's plumbing that ``REST_FRAMEWORK`` names (the registry is the API's only set of
DRF views; the scoring endpoints are the fast path's): the body parser and the exception handler.

``BoundedJSONParser`` reads the body once with a hard size limit, parses it with ``orjson`` and
refuses it when nested deeper than ``KVCACHE_MAX_JSON_DEPTH`` (the fast path's check,
``scoring.fastpath.schema.json_depth_exceeds``).

``exception_handler`` answers every exception in the API's one error shape
(``registry.api.errors``). The mapping from exceptions to HTTP statuses:

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

import json
import logging
from collections.abc import Mapping
from typing import Any

import orjson
from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.parsers import BaseParser
from rest_framework.response import Response

from registry.api.errors import ApiError, BodyTooLarge, error_body
from scoring.fastpath.errors import from_core
from scoring.fastpath.schema import json_depth_exceeds

logger = logging.getLogger(__name__)


class BoundedJSONParser(BaseParser):
    """Parses the request body as JSON, refusing one larger than ``KVCACHE_MAX_BODY_BYTES``
    (413) before reading more than one byte past the limit, and one nesting arrays and objects
    deeper than ``KVCACHE_MAX_JSON_DEPTH`` (400 ``invalid_json``; never a ``RecursionError``,
    however deep)."""

    media_type = "application/json"

    def parse(
        self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None
    ) -> Any:
        limit = settings.KVCACHE_MAX_BODY_BYTES
        request = (parser_context or {}).get("request")
        declared = request.META.get("CONTENT_LENGTH") if request is not None else None
        if declared and declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(limit)
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise BodyTooLarge(limit)
        depth_limit = settings.KVCACHE_MAX_JSON_DEPTH
        value = _loads(raw, depth_limit)
        if json_depth_exceeds(raw, value, depth_limit):
            raise _too_deep(depth_limit)
        return value


def _loads(raw: bytes, depth_limit: int) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    # orjson refuses some JSON that the standard allows and that a field should judge (an
    # integer beyond 64 bits, a lone surrogate escape): the standard parser says either what is
    # wrong with the text or what the field has to refuse. orjson also refuses more than 1024
    # levels of nesting, on which the standard parser recurses until Python stops it.
    try:
        # Decoded here, strictly: json.loads would take UTF-16 and UTF-32 bodies, and encoded
        # surrogates; and no NaN or Infinity, which JSON does not have.
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep(depth_limit) from None
    except UnicodeDecodeError as error:
        raise exceptions.ParseError(
            f"the body is not UTF-8 text ({error.reason}): send JSON in UTF-8"
        ) from None
    except ValueError as error:
        raise exceptions.ParseError(f"the body is not valid JSON: {error}") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _too_deep(limit: int) -> exceptions.ParseError:
    return exceptions.ParseError(
        f"the body's JSON is nested deeper than {limit} levels (KVCACHE_MAX_JSON_DEPTH): flatten it"
    )


def exception_handler(exc: Exception, context: Mapping[str, Any]) -> Response:
    """DRF's ``EXCEPTION_HANDLER``: every exception becomes a response in our shape."""
    # Imported here, not at the top: DRF imports this module (DEFAULT_PARSER_CLASSES) while it
    # loads rest_framework.views.
    from rest_framework.views import set_rollback

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
