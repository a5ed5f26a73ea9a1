"""The registry's side of a fleet of real engines: their model's config (the engines themselves
go in with ``registry.services.register_pods``)."""

from __future__ import annotations

from pathlib import Path

from registry.models import ModelConfig
from registry.services import save_model_config


def register_model(*, model: str, model_dir: Path | str, block_size: int, max_model_len: int) -> None:
    """Register ``model`` as its engines serve it: their block size, the model's own tokenizer
    (and chat template), its context length. Raises ``ValidationError`` when the config cannot
    be saved (its tokenizer does not load)."""
    config = ModelConfig.objects.filter(name=model).first() or ModelConfig(name=model)
    config.block_size = block_size
    config.tokenizer_source = str(model_dir)
    config.max_model_len = max_model_len
    save_model_config(config)
