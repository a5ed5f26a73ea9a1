"""The fast path (``scoring.fastpath.app``) wired to this process: its settings read from
Django's, its handles (registry snapshot, index, tokenizers, template sandbox) from
``registry.runtime``. ``kvsite.asgi`` serves it."""

from __future__ import annotations

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from registry import runtime
from scoring.fastpath.app import FastPathSettings, Handles, ScoringApp

_fastpath_settings: FastPathSettings | None = None


def fastpath_settings() -> FastPathSettings:
    """The fast path's settings, read once from Django's (again after a test changes one)."""
    global _fastpath_settings
    if _fastpath_settings is None:
        _fastpath_settings = FastPathSettings(
            api_keys=tuple(settings.KVCACHE_API_KEYS),
            max_body_bytes=settings.KVCACHE_MAX_BODY_BYTES,
            allow_request_templates=settings.KVCACHE_REQUEST_TEMPLATES,
            threads=settings.KVCACHE_SCORING_THREADS,
            max_json_depth=settings.KVCACHE_MAX_JSON_DEPTH,
        )
    return _fastpath_settings


@receiver(setting_changed)
def _settings_changed(**kwargs: object) -> None:
    global _fastpath_settings
    _fastpath_settings = None


def build_scoring_app() -> ScoringApp:
    """The fast path, wired to this process's handles."""
    return ScoringApp(
        Handles(
            settings=fastpath_settings,
            config=runtime.config_source,
            index=runtime.get_index,
            tokenizers=runtime.get_tokenizers,
            sandbox=runtime.get_sandbox,
            dynamo_blocks=runtime.get_dynamo_blocks,
        )
    )
