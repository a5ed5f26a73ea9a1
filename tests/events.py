"""KV events built from the real vLLM captures, for tests that publish them."""

from __future__ import annotations

from ingest.events import BlockStored


def stored_event(
    capture: dict, *, first: int = 0, last: int = 25, parent: int | None = None, **changes
) -> BlockStored:
    """The BlockStored event an engine sends for blocks ``first..last-1`` of a capture
    (block size 16, GPU, the capture's LoRA name); ``changes`` override any field."""
    fields = dict(
        block_hashes=tuple(capture["block_hashes"][first:last]),
        parent_block_hash=parent,
        token_ids=tuple(capture["token_ids"][first * 16 : last * 16]),
        block_size=16,
        lora_id=None,
        tier="gpu",
        lora_name=capture["lora_name"],
        extra_keys=None,
        group_idx=None,
    )
    fields.update(changes)
    return BlockStored(**fields)
