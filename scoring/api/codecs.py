"""JSON in and out of the scoring endpoints: size-limited, lenient about headers, compact.

Schedulers call these endpoints on every request, so the codecs do the least that is correct:
the body is read once with a hard size limit and parsed by ``orjson`` (4x faster than ``json``
on a body of 2k token ids); responses are compact JSON whatever the ``Accept`` header says
(there is only one representation).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson
from django.conf import settings
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.parsers import BaseParser
from rest_framework.renderers import BaseRenderer

from scoring.api.errors import ApiError, BodyTooLarge


class BoundedJSONParser(BaseParser):
    """Parses the request body as JSON, refusing one larger than ``KVCACHE_MAX_BODY_BYTES``
    (413) before reading more than one byte past the limit. With ``FirstRenderer`` it is used
    whatever the ``Content-Type`` (not every upstream client sends ``application/json``)."""

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
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
        # orjson refuses some JSON that the standard allows and that a field should judge (an
        # integer beyond 64 bits, a lone surrogate escape): the standard parser says either what
        # is wrong with the text or what the field has to refuse.
        try:
            return json.loads(raw)
        except UnicodeDecodeError as error:
            raise ApiError(400, "invalid_json", f"the body is not UTF-8 text: {error.reason}") from None
        except ValueError as error:
            raise ApiError(400, "invalid_json", f"the body is not valid JSON: {error}") from None


class CompactJSONRenderer(BaseRenderer):
    """Compact UTF-8 JSON (NaN and infinities, which are not JSON, become null)."""

    media_type = "application/json"
    format = "json"
    charset = None

    def render(
        self,
        data: Any,
        accepted_media_type: str | None = None,
        renderer_context: Mapping[str, Any] | None = None,
    ) -> bytes:
        if data is None:
            return b""
        return orjson.dumps(data)


class FirstRenderer(BaseContentNegotiation):
    """The view's first parser and first renderer, whatever the headers say: a scheduler sending
    ``Accept: text/html`` or no ``Content-Type`` still gets its JSON, not a 406 or a 415."""

    def select_parser(self, request: Any, parsers: list[BaseParser]) -> BaseParser | None:
        return parsers[0] if parsers else None

    def select_renderer(
        self, request: Any, renderers: list[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        renderer = renderers[0]
        return renderer, renderer.media_type
