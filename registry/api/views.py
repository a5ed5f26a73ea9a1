"""The registry over HTTP, for staff users: pods, model configs, the hash seed.

Every write goes through ``registry.services`` (as the admin's do), so the API has the admin's
effects: disabling or deleting a pod removes its blocks, a new block size clears the model's
index, a new hash seed clears the whole index, and every process sees the change within a config
refresh (``registry.selectors.CONFIG_REFRESH_SECONDS``).
"""

from __future__ import annotations

from typing import Any

from django.db.models import Model
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import Serializer
from rest_framework.views import APIView

from registry import runtime, selectors, services
from registry.api.auth import STAFF_AUTHENTICATION, STAFF_HINT, STAFF_PERMISSIONS
from registry.api.errors import ApiError
from registry.api.serializers import (
    HashSeedSerializer,
    ModelConfigSerializer,
    PodSerializer,
    PodStateSerializer,
)
from registry.models import ModelConfig, Pod


class StaffView(APIView):
    """Staff only: session or HTTP basic login; 401 when not logged in, 403 when not staff."""

    authentication_classes = STAFF_AUTHENTICATION
    permission_classes = STAFF_PERMISSIONS
    auth_hint = STAFF_HINT


def _apply(instance: Model, changes: dict[str, Any], serializer: Serializer, *, reset_missing: bool) -> None:
    """Set ``changes`` on ``instance``; with ``reset_missing`` (PUT replaces), writable fields the
    body left out go back to their defaults instead of keeping their old values."""
    if reset_missing:
        for name, field in serializer.fields.items():
            if not field.read_only and name not in changes:
                setattr(instance, name, instance._meta.get_field(name).get_default())
    for name, value in changes.items():
        setattr(instance, name, value)


def _pod_state(pod: Pod) -> dict[str, Any]:
    return PodStateSerializer(selectors.pod_states(runtime.get_index(), [pod])[0]).data


@extend_schema(tags=["registry (staff)"])
class PodListView(StaffView):
    @extend_schema(
        operation_id="pods_list",
        summary="Every registered pod, with live block counts and ingest stream stats",
        responses={200: PodStateSerializer(many=True)},
    )
    def get(self, request: Request) -> Response:
        return Response(PodStateSerializer(selectors.pod_states(runtime.get_index()), many=True).data)

    @extend_schema(
        operation_id="pods_create",
        summary="Register a pod",
        request=PodSerializer,
        responses={201: PodStateSerializer},
    )
    def post(self, request: Request) -> Response:
        serializer = PodSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        pod = services.save_pod(Pod(**serializer.validated_data))
        return Response(_pod_state(pod), status=status.HTTP_201_CREATED)


@extend_schema(tags=["registry (staff)"])
class PodDetailView(StaffView):
    @extend_schema(operation_id="pods_retrieve", summary="One pod", responses={200: PodStateSerializer})
    def get(self, request: Request, pod_id: str) -> Response:
        return Response(_pod_state(get_object_or_404(Pod, pod_id=pod_id)))

    @extend_schema(
        operation_id="pods_update",
        summary="Replace a pod's settings (disabling it removes its blocks)",
        request=PodSerializer,
        responses={200: PodStateSerializer},
    )
    def put(self, request: Request, pod_id: str) -> Response:
        return self._update(request, pod_id, partial=False)

    @extend_schema(
        operation_id="pods_partial_update",
        summary="Change some of a pod's settings (disabling it removes its blocks)",
        request=PodSerializer,
        responses={200: PodStateSerializer},
    )
    def patch(self, request: Request, pod_id: str) -> Response:
        return self._update(request, pod_id, partial=True)

    @extend_schema(operation_id="pods_destroy", summary="Delete a pod and its blocks", responses={204: None})
    def delete(self, request: Request, pod_id: str) -> Response:
        services.delete_pod(get_object_or_404(Pod, pod_id=pod_id))
        return Response(status=status.HTTP_204_NO_CONTENT)

    def _update(self, request: Request, pod_id: str, *, partial: bool) -> Response:
        pod = get_object_or_404(Pod, pod_id=pod_id)
        serializer = PodSerializer(pod, data=request.data, partial=partial)
        serializer.is_valid(raise_exception=True)
        changes = serializer.validated_data
        if changes.get("pod_id", pod_id) != pod_id:
            raise ApiError(
                400,
                "invalid_request",
                "pod_id: cannot be changed (the index knows the pod by it): delete the pod and create "
                "the new one",
                fields={"pod_id": ["cannot be changed"]},
            )
        _apply(pod, changes, serializer, reset_missing=not partial)
        return Response(_pod_state(services.save_pod(pod)))


@extend_schema(tags=["registry (staff)"])
class ModelConfigListView(StaffView):
    @extend_schema(
        operation_id="models_list",
        summary="Every model config",
        responses={200: ModelConfigSerializer(many=True)},
    )
    def get(self, request: Request) -> Response:
        return Response(ModelConfigSerializer(ModelConfig.objects.all(), many=True).data)

    @extend_schema(
        operation_id="models_create",
        summary="Configure a model (a block size other than the default clears its index)",
        request=ModelConfigSerializer,
        responses={201: ModelConfigSerializer},
    )
    def post(self, request: Request) -> Response:
        serializer = ModelConfigSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        config = services.save_model_config(ModelConfig(**serializer.validated_data))
        return Response(ModelConfigSerializer(config).data, status=status.HTTP_201_CREATED)


@extend_schema(tags=["registry (staff)"])
class ModelConfigDetailView(StaffView):
    @extend_schema(
        operation_id="models_retrieve", summary="One model config", responses={200: ModelConfigSerializer}
    )
    def get(self, request: Request, name: str) -> Response:
        return Response(ModelConfigSerializer(get_object_or_404(ModelConfig, name=name)).data)

    @extend_schema(
        operation_id="models_update",
        summary="Replace a model config (a new block size clears the model's index)",
        request=ModelConfigSerializer,
        responses={200: ModelConfigSerializer},
    )
    def put(self, request: Request, name: str) -> Response:
        return self._update(request, name, partial=False)

    @extend_schema(
        operation_id="models_partial_update",
        summary="Change some of a model config (a new block size clears the model's index)",
        request=ModelConfigSerializer,
        responses={200: ModelConfigSerializer},
    )
    def patch(self, request: Request, name: str) -> Response:
        return self._update(request, name, partial=True)

    @extend_schema(operation_id="models_destroy", summary="Delete a model config", responses={204: None})
    def delete(self, request: Request, name: str) -> Response:
        services.delete_model_config(get_object_or_404(ModelConfig, name=name))
        return Response(status=status.HTTP_204_NO_CONTENT)

    def _update(self, request: Request, name: str, *, partial: bool) -> Response:
        config = get_object_or_404(ModelConfig, name=name)
        serializer = ModelConfigSerializer(config, data=request.data, partial=partial)
        serializer.is_valid(raise_exception=True)
        _apply(config, serializer.validated_data, serializer, reset_missing=not partial)
        return Response(ModelConfigSerializer(services.save_model_config(config)).data)


@extend_schema(tags=["registry (staff)"])
class HashSeedView(StaffView):
    @extend_schema(
        operation_id="hash_seed_retrieve", summary="The hash seed", responses={200: HashSeedSerializer}
    )
    def get(self, request: Request) -> Response:
        return Response(HashSeedSerializer(services.current_hash_seed()).data)

    @extend_schema(
        operation_id="hash_seed_update",
        summary="Set the hash seed (the engines' PYTHONHASHSEED); a change clears the whole index",
        request=HashSeedSerializer,
        responses={200: HashSeedSerializer},
    )
    def put(self, request: Request) -> Response:
        serializer = HashSeedSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        return Response(HashSeedSerializer(services.set_hash_seed(serializer.validated_data["value"])).data)

    @extend_schema(
        operation_id="hash_seed_partial_update",
        summary="Same as PUT (the seed is the only setting)",
        request=HashSeedSerializer,
        responses={200: HashSeedSerializer},
    )
    def patch(self, request: Request) -> Response:
        return self.put(request)
