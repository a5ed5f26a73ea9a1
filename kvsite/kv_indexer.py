"""The registry writes of Dynamo's KV-indexer API, ``POST /kv-indexer/register`` and
``/kv-indexer/unregister``: thin Django views over ``registry.services`` (their request and error
shapes are ``scoring.kv_indexer``'s; the reads are the fast path's, ``scoring.fastpath.kv_indexer``).

They make ingest connect to an address, so they take the registry API's authority: a staff user,
by HTTP basic auth (a Dynamo client's ``Authorization`` header) or a session, failed logins
throttled (``registry.api.auth``). Refusals of the login are the registry API's (401, 403, 429);
everything after it answers as Dynamo does, ``{"error": message}``.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.http import JsonResponse
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.views import APIView

from registry import services
from registry.api.auth import STAFF_AUTHENTICATION, STAFF_HINT, STAFF_PERMISSIONS
from scoring import kv_indexer
from scoring.kv_indexer import IndexerError, RegisterRequest, UnregisterRequest

MAX_BODY_BYTES = 64 * 1024
"""A registration is a few hundred bytes."""

# Our registry's field names, as Dynamo's requests call them.
_DYNAMO_FIELDS = {
    "pod_id": "instance_id",
    "event_endpoint": "endpoint",
    "model": "model_name",
    "name": "model_name",
    "block_size": "block_size",
    "replay_endpoint": "replay_endpoint",
}


@extend_schema(exclude=True)  # documented with the fast path's endpoints (scoring.fastpath.openapi)
class _StaffWrite(APIView):
    authentication_classes = STAFF_AUTHENTICATION
    permission_classes = STAFF_PERMISSIONS
    auth_hint = STAFF_HINT
    kind: type

    def post(self, request: Request) -> JsonResponse:
        try:
            declared = request.META.get("CONTENT_LENGTH") or "0"
            if not declared.isdigit() or int(declared) > MAX_BODY_BYTES:
                raise IndexerError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            body = kv_indexer.decode_request(
                request.body,
                request.META.get("CONTENT_TYPE"),
                self.kind,
                max_depth=settings.KVCACHE_MAX_JSON_DEPTH,
            )
            self.write(body)
        except IndexerError as error:
            return JsonResponse(error.body(), status=error.status)
        except services.RegistrationConflict as error:
            return JsonResponse({"error": str(error)}, status=409)
        except LookupError as error:
            return JsonResponse({"error": str(error.args[0])}, status=404)
        except ValidationError as error:
            return JsonResponse({"error": _explain(error)}, status=400)
        return JsonResponse({"status": "ok"}, status=self.created)

    def write(self, body: Any) -> None:
        raise NotImplementedError


class RegisterView(_StaffWrite):
    """Creates or updates the pod ``instance_id`` with its event endpoint (201)."""

    kind = RegisterRequest
    created = 201

    def write(self, body: RegisterRequest) -> None:
        _check_group(body.routing_group)
        services.register_event_publisher(
            pod_id=kv_indexer.pod_id(body.instance_id),
            model=body.model_name,
            event_endpoint=body.endpoint,
            block_size=body.block_size,
            dp_rank=body.dp_rank or 0,
            replay_endpoint=body.replay_endpoint,
        )


class UnregisterView(_StaffWrite):
    """Removes the pod ``instance_id`` and its blocks, or one rank's blocks (200)."""

    kind = UnregisterRequest
    created = 200

    def write(self, body: UnregisterRequest) -> None:
        pod = kv_indexer.pod_id(body.instance_id)
        if body.routing_group is not None and body.routing_group != kv_indexer.DEFAULT_GROUP:
            raise LookupError(
                f"instance {pod} is registered for model={body.model_name} routing_group=default"
            )
        # As Dynamo: a rank alone only within a routing group; without one, the whole instance.
        rank = body.dp_rank if body.routing_group is not None else None
        services.unregister_event_publisher(pod_id=pod, model=body.model_name, dp_rank=rank)


def _check_group(routing_group: str) -> None:
    if routing_group != kv_indexer.DEFAULT_GROUP:
        raise IndexerError(
            400,
            f'routing_group: only "default" is served here (one partition per model), not {routing_group!r}',
        )


def _explain(error: ValidationError) -> str:
    """``field: problem; ...`` in Dynamo's field names."""
    if not hasattr(error, "error_dict"):
        return "; ".join(error.messages)
    return "; ".join(
        f"{_DYNAMO_FIELDS.get(field, field)}: {message}"
        for field, problems in error.message_dict.items()
        for message in problems
    )
