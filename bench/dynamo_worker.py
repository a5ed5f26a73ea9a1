"""One pod (a simulated or real vLLM OpenAI server) as a Dynamo worker: the shim that lets
Dynamo's KV router (``python -m dynamo.frontend --router-mode kv``) route to pods it did not
start. ``bench/dynamo.py`` runs one per pod; it runs under Dynamo's own venv (``var/dynamo``,
``make bench-dynamo``), never the project's, and with ``python -P`` so that ``bench/dynamo.py``
cannot shadow the ``dynamo`` package.

What Dynamo's router needs of a worker, and where the shim gets it:

* **Requests.** Dynamo's frontend tokenizes (its own Rust preprocessor, chat template applied),
  picks a worker and sends it the token ids; the shim posts them to the pod's
  ``/v1/completions`` as a token-id prompt (streamed), so the pod caches exactly the tokens the
  router hashed. The output goes back as token ids, which the frontend detokenizes: the pod's own
  (vLLM's ``return_token_ids``, which the simulator honours too), or else each streamed text piece
  tokenized again. The pod's usage (with its ``cached_tokens``) is passed on.
* **KV events.** The pod's own ZeroMQ PUB socket (vLLM's format, ``[topic, seq, msgpack batch]``)
  is handed to Dynamo's worker runtime as a ``ZmqSource``: Dynamo's vLLM worker wrapper
  (``dynamo.vllm``) does the same with vLLM's socket. The pod must bind its PUB
  (``simulate --events-endpoint tcp://*:PORT``, or vLLM's default); the relay subscribes.
* **Load.** Nothing: Dynamo's router counts the prefill tokens and decode blocks it has sent to
  each worker itself (its default); worker-reported load only feeds thresholds that are off by
  default.

    var/dynamo/bin/python -P bench/dynamo_worker.py --pod-url http://127.0.0.1:8100 \\
        --events tcp://127.0.0.1:5600 --model-dir DIR --served-model-name Qwen/Qwen3-0.6B \\
        --block-size 16 --discovery-backend file
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.publisher import KvEventSource, ZmqSource
from dynamo.common.backend.run import run
from tokenizers import Tokenizer

log = logging.getLogger("dynamo_worker")

# What the pod's completions request takes from Dynamo's request (``stop_conditions`` and
# ``sampling_options``); the rest (stop strings, logprobs) is the frontend's to apply.
STOP_FIELDS = ("max_tokens", "min_tokens", "ignore_eos")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "n")


def pod_request(request: dict[str, Any], model: str) -> dict[str, Any]:
    """The pod's streamed ``/v1/completions`` body for one Dynamo request: its token ids as the
    prompt, the limits and sampling options it sets, usage in the stream."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request["token_ids"]),
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    for group, names in (("stop_conditions", STOP_FIELDS), ("sampling_options", SAMPLING_FIELDS)):
        values = request.get(group) or {}
        body.update({name: values[name] for name in names if values.get(name) is not None})
    return body


class PodError(RuntimeError):
    """The pod answered with an error status; the message carries its body."""


class PodEngine(LLMEngine):
    """A Dynamo ``LLMEngine`` whose engine is a pod behind HTTP."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.session: aiohttp.ClientSession | None = None
        self._tokenizer: Tokenizer | None = None

    def token_ids(self, choice: dict[str, Any]) -> list[int]:
        """A streamed choice's token ids: the pod's, else its text tokenized (the tokenizer, some
        100 MB, is loaded only for a pod that does not send ids)."""
        if isinstance(choice.get("token_ids"), list):
            return choice["token_ids"]
        if not choice.get("text"):
            return []
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_file(f"{self.args.model_dir}/tokenizer.json")
        return self._tokenizer.encode(choice["text"], add_special_tokens=False).ids

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple[PodEngine, WorkerConfig]:
        args = parse_args(argv)
        config = WorkerConfig(
            namespace=args.namespace,
            component=args.component,
            endpoint="generate",
            model_name=args.model_dir,
            served_model_name=args.served_model_name,
            discovery_backend=args.discovery_backend,
            request_plane="tcp",
            event_plane="zmq",
        )
        return cls(args), config

    async def start(self, worker_id: int) -> EngineConfig:
        # No limit on connections: the pod queues, as it would behind any router; no proxies.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), trust_env=False, timeout=aiohttp.ClientTimeout()
        )
        log.info("worker %s serves pod %s", worker_id, self.args.pod_url)
        return EngineConfig(
            model=self.args.model_dir,
            served_model_name=self.args.served_model_name,
            llm=LlmRegistration(
                context_length=self.args.context_length,
                kv_cache_block_size=self.args.block_size,
                total_kv_blocks=self.args.kv_blocks,
            ),
        )

    async def kv_event_sources(self) -> list[KvEventSource]:
        if not self.args.events:
            return []
        return [ZmqSource(endpoint=self.args.events, topic=self.args.topic)]

    async def generate(self, request: dict[str, Any], context: Any) -> AsyncGenerator[dict[str, Any], None]:
        assert self.session is not None, "generate() before start()"
        body = pod_request(request, self.args.served_model_name)
        url = f"{self.args.pod_url}/v1/completions"
        finish: str | None = None
        usage: dict[str, Any] | None = None
        async with self.session.post(url, json=body) as response:
            if response.status != 200:
                raise PodError(f"pod {self.args.pod_url} answered {response.status}: {await response.text()}")
            async for line in response.content:
                if context.is_stopped():
                    return
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    ids = self.token_ids(choice)
                    finish = choice.get("finish_reason") or finish
                    if ids:
                        yield {"token_ids": ids, "index": 0}
        final: dict[str, Any] = {"token_ids": [], "index": 0, "finish_reason": finish or "stop"}
        if usage:
            final["completion_usage"] = usage
        yield final

    async def cleanup(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A pod behind HTTP as a Dynamo worker.")
    parser.add_argument("--pod-url", required=True, help="the pod's base URL")
    parser.add_argument("--events", default="", help="the pod's bound KV-event PUB endpoint ('' : none)")
    parser.add_argument("--topic", default="", help="KV-event topic prefix to subscribe to")
    parser.add_argument("--model-dir", required=True, help="config.json and tokenizer files")
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--block-size", type=int, required=True, help="the pod's KV block size")
    parser.add_argument("--kv-blocks", type=int, default=None, help="the pod's KV cache size in blocks")
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--namespace", default="dynamo")
    parser.add_argument("--component", default="backend")
    parser.add_argument("--discovery-backend", default="file", choices=["file", "etcd", "mem"])
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(PodEngine)
