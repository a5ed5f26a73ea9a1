"""Temporary: only the command line of ``python manage.py epp``, so that the deploy manifests are
checked against it (``tests/deploy/test_manifests.py``). Replaced by the real command."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    help = "The Endpoint Picker (ext_proc gRPC) for the Gateway API Inference Extension (not yet here)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--grpc-port", type=int, required=True)
        parser.add_argument("--metrics-port", type=int, required=True)
        parser.add_argument("--host", default="0.0.0.0")
        parser.add_argument("--pool-name")
        parser.add_argument("--pod-selector")
        parser.add_argument("--target-port", type=int)
        parser.add_argument("--pool-namespace")
        parser.add_argument("--pool-model")
        parser.add_argument("--policy", default="kv-load")
        parser.add_argument("--fail-open", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        raise CommandError("manage.py epp is not on this branch yet")
