"""The registry's side of a fleet of real engines: their model's config and the engines."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from django.core.exceptions import ValidationError

from registry.models import ModelConfig
from registry.services import register_pods, save_model_config


def register_engines(
    *,
    model: str,
    model_dir: Path | str,
    block_size: int,
    max_model_len: int,
    engines: Iterable[tuple[str, str, str]],
) -> None:
    """Register ``model`` (the engines' block size, the model's own tokenizer and chat template,
    its context length) and each engine ``(pod, host:port, replay endpoint)`` of it. Raises
    ``ValidationError`` when the model config cannot be saved (its tokenizer does not load)."""
    config = ModelConfig.objects.filter(name=model).first() or ModelConfig(name=model)
    config.block_size = block_size
    config.tokenizer_source = str(model_dir)
    config.max_model_len = max_model_len
    save_model_config(config)
    register_pods((pod, model, address, replay) for pod, address, replay in engines)


__all__ = ["ValidationError", "register_engines"]
