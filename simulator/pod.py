"""One simulated vLLM pod: its engines (one per data-parallel rank), tokenizer, LoRA adapters,
live configuration, failure injection and metrics. No HTTP here (``simulator.server`` is the shell).

A request goes: model name -> adapter (or 404) -> injected failure? -> token ids (the manager's
tokenizer and chat template, so router and pod agree on every block key) -> context-window check
(400 with vLLM's message) -> outputs decided (echo or random) -> one engine request per prompt and
choice, all on the least loaded rank so that choices share their prompt's blocks.

Prefill/decode disaggregation (``kv_transfer_params``, vLLM NixlConnector's): any pod, whatever
its ``role``, prefills for another pod (``do_remote_decode``: one token, finish reason
``remote_decode``, and :meth:`Pod.kv_transfer_answer` for the decode request) and decodes what
another pod prefilled (``do_remote_prefill``: the prompt's KV beyond the local prefix hit is
loaded, see ``simulator.engine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from ingest.applier import holder_id
from ingest.events import Event
from simulator.config import (
    ConfigError,
    FailureConfig,
    LatencyConfig,
    LoraAdapter,
    PodConfig,
    as_dict,
    updated,
)
from simulator.engine import Engine, EngineRequest, EngineSleeping, QueueFull, RequestState, RequestTooLarge
from simulator.errors import (
    OpenAIError,
    bad_request,
    context_length_exceeded,
    inject_failure,
    model_not_found,
    queue_full,
)
from simulator.metrics import PodMetrics
from simulator.outputs import SENTENCES, Output, echo_output, random_output, request_rng, token_texts
from simulator.protocol import ChatParams, KVTransferParams, SamplingParams, Usage
from tokenization.chat_templates import ChatTemplateError, render_chat
from tokenization.tokenizers import LoadedTokenizer, TokenizerRegistry

__all__ = ["Choice", "Pod", "PodTokenizer", "RankLoad", "Submission"]

DEFAULT_MAX_LORAS = 8
REMOTE_DECODE: Final = "remote_decode"
"""The finish reason of a prefill for another pod (llm-d-inference-sim's; vLLM reports ``length``,
the prefill request's ``max_tokens`` being 1)."""


class PodTokenizer:
    """A model's tokenizer exactly as the manager uses it: ``TokenizerRegistry.tokenize`` (no
    special tokens added) and ``tokenization.chat_templates.render_chat`` with the request's chat
    template, else ``chat_template`` (the model config's, as the manager), else the tokenizer's own.
    Raises ``TokenizerError`` at construction when the model has no tokenizer."""

    def __init__(self, registry: TokenizerRegistry, model: str, *, chat_template: str | None = None) -> None:
        self.registry = registry
        self.model = model
        self.chat_template = chat_template or None
        self.loaded: LoadedTokenizer = registry.get(model)

    def encode(self, text: str) -> list[int]:
        """Prompt text to token ids, through the registry's prefix store as the manager does."""
        return self.registry.tokenize(self.model, text).token_ids

    def encode_text(self, text: str) -> list[int]:
        """Any other text (generated output, a message to echo) to token ids, without filling the
        prefix store with text no prompt will start with."""
        return self.loaded.encode(text).ids

    def render(self, params: ChatParams) -> str:
        """The conversation as prompt text; ``ChatTemplateError`` when it cannot be rendered."""
        return render_chat(
            params.messages,
            templates=self.loaded.chat_templates,
            chat_template=params.chat_template if params.chat_template is not None else self.chat_template,
            tools=params.tools,
            documents=params.documents,
            add_generation_prompt=params.add_generation_prompt,
            continue_final_message=params.continue_final_message,
            chat_template_kwargs=params.chat_template_kwargs,
        ).text

    def texts(self, token_ids: Sequence[int]) -> list[str]:
        return token_texts(self.loaded.backend, token_ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.loaded.backend.decode(list(token_ids), skip_special_tokens=True)


@dataclass(eq=False, slots=True)
class Choice:
    """One output sequence of a request: ``index`` in the response, the prompt it continues."""

    index: int
    prompt_index: int
    engine: Engine
    state: RequestState
    texts: list[str]

    @property
    def finish_reason(self) -> str:
        return self.state.request.finish_reason

    @property
    def last_token(self) -> int:
        return len(self.state.request.output_ids) - 1


@dataclass(eq=False, slots=True)
class Submission:
    """A request accepted by an engine: its choices in response order, and per prompt its token
    count. Usage counts each prompt once, with the cached tokens of its first choice (vLLM's
    parallel sampling reports the parent request's)."""

    request_id: str
    model: str
    created: int
    choices: list[Choice]
    prompt_tokens: list[int] = field(default_factory=list)
    kv_transfer: KVTransferParams | None = None

    def usage(self) -> Usage:
        firsts: dict[int, Choice] = {}
        for choice in self.choices:
            firsts.setdefault(choice.prompt_index, choice)
        return Usage(
            prompt_tokens=sum(self.prompt_tokens),
            completion_tokens=sum(c.state.generated for c in self.choices),
            cached_tokens=sum(self._cached_tokens(c) for c in firsts.values()),
        )

    def _cached_tokens(self, choice: Choice) -> int:
        """The cached tokens vLLM (0.32) reports: the local prefix hit; for a decode of another
        pod's prefill, the prefill's hit when the request carries it (the prefill answer's
        ``remote_prefill_cached_tokens``), else every prompt token it did not compute (local hit
        and transferred)."""
        state = choice.state
        if not state.request.remote_prefill:
            return state.cached_tokens
        if self.kv_transfer is not None and self.kv_transfer.remote_prefill_cached_tokens is not None:
            return self.kv_transfer.remote_prefill_cached_tokens
        return state.cached_tokens + state.transferred_tokens


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One data-parallel rank's load: requests running and waiting, and ``tokens``, the tokens in
    the KV blocks running requests hold plus the prompt tokens still waiting (SGLang's
    ``num_tokens``, what its routers balance on)."""

    rank: int
    running: int
    waiting: int
    tokens: int


class Pod:
    """A simulated pod. ``on_events[r]`` receives the event batches of rank ``r`` (``None``: no
    publishing). ``clock``/``sleep`` are the engines' time (tests use zero latencies instead)."""

    def __init__(
        self,
        config: PodConfig,
        *,
        tokenizer: PodTokenizer,
        on_events: Sequence[Callable[[list[Event]], None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        max_loras: int = DEFAULT_MAX_LORAS,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_loras = max_loras
        self.failures = config.failures
        self.loras: dict[str, LoraAdapter] = {a.name: a for a in config.lora_adapters}
        self._next_lora_id = max((a.lora_id for a in config.lora_adapters), default=0) + 1
        self._failure_rng = random.Random(f"failures:{config.seed}:{config.pod_id}")
        self.metrics = PodMetrics(
            config.model, engines=lambda: self.engines, max_loras=lambda: self.max_loras
        )
        if on_events is not None and len(on_events) != config.data_parallel_size:
            raise ValueError("on_events needs one callback per data-parallel rank")
        self.engines = [
            Engine(
                config=config.engine,
                latency=config.latency,
                on_events=on_events[rank] if on_events is not None else None,
                observer=self.metrics.observer(rank),
                seed=f"{config.seed}:{config.pod_id}:{rank}",
                clock=clock,
                sleep=sleep,
            )
            for rank in range(config.data_parallel_size)
        ]
        self._fallback_echo = tuple(tokenizer.encode_text(SENTENCES[0]))

    @property
    def model(self) -> str:
        return self.config.model

    @property
    def latency(self) -> LatencyConfig:
        return self.engines[0].latency

    # --- models and adapters ---------------------------------------------------------------------

    def adapter_for(self, model: str) -> LoraAdapter | None:
        """The adapter a request's ``model`` names (``None`` for the base model); 404 otherwise."""
        if model == self.config.model:
            return None
        adapter = self.loras.get(model)
        if adapter is None:
            raise model_not_found(model)
        return adapter

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        if not name or "@" in name:
            raise bad_request("lora_name must be a non-empty name", "lora_name")
        if name in self.loras or name == self.config.model:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if len(self.loras) >= self.max_loras:
            raise bad_request(
                f"at most {self.max_loras} LoRA adapters can be loaded: unload one first", "lora_name"
            )
        adapter = LoraAdapter(name=name, path=path, lora_id=self._next_lora_id)
        self._next_lora_id += 1
        self.loras[name] = adapter
        return adapter

    def unload_lora(self, name: str) -> None:
        if self.loras.pop(name, None) is None:
            raise OpenAIError(
                404,
                f"The lora adapter '{name}' cannot be found.",
                type="invalid_request_error",
                param="lora_name",
            )

    # --- configuration ---------------------------------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "pod_id": c.pod_id,
            "model": c.model,
            "output_mode": c.output_mode,
            "seed": c.seed,
            "data_parallel_size": c.data_parallel_size,
            "role": c.role,
            "engine": as_dict(c.engine),
            "latency": as_dict(self.latency),
            "failures": as_dict(self.failures),
        }

    def update_config(self, changes: object) -> dict[str, Any]:
        """Apply ``{"latency": {...}, "failures": {...}}`` (partial) to every rank; all or nothing.
        Raises ``ConfigError`` naming what cannot change or is invalid."""
        if not isinstance(changes, Mapping):
            raise ConfigError('expected {"latency": {...}, "failures": {...}}')
        fixed = sorted(set(changes) - {"latency", "failures"})
        if fixed:
            raise ConfigError(f"only latency and failures can change while the pod runs, not {fixed}")
        latency = updated(self.latency, changes.get("latency", {}))
        failures: FailureConfig = updated(self.failures, changes.get("failures", {}))
        for engine in self.engines:
            engine.latency = latency
        self.failures = failures
        return self.config_dict()

    # --- cache control ---------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Reset every rank's prefix cache; false (nothing reset) while any request holds blocks."""
        if any(e.cache.num_used for e in self.engines):
            return False
        return all([engine.reset_prefix_cache() for engine in self.engines])

    def sleep(self) -> bool:
        if any(e.num_running or e.num_waiting for e in self.engines):
            return False
        return all([engine.sleep_mode() for engine in self.engines])

    def wake_up(self) -> None:
        for engine in self.engines:
            engine.wake_up()

    @property
    def sleeping(self) -> bool:
        return self.engines[0].sleeping

    def loads(self) -> list[RankLoad]:
        """Each rank's load, in rank order."""
        return [
            RankLoad(
                rank=rank,
                running=engine.num_running,
                waiting=engine.num_waiting,
                tokens=engine.cache.num_used * engine.cache.block_size + engine.waiting_prompt_tokens,
            )
            for rank, engine in enumerate(self.engines)
        ]

    # --- requests --------------------------------------------------------------------------------

    def maybe_fail(self, model: str) -> None:
        """Raise the injected failure for this request, if one is drawn."""
        failure = inject_failure(self.failures, self._failure_rng, model)
        if failure is not None:
            raise failure

    def chat_prompt(self, params: ChatParams) -> tuple[list[int], list[int]]:
        """The conversation's prompt token ids, and the last message's (what echo returns)."""
        try:
            text = self.tokenizer.render(params)
        except ChatTemplateError as error:
            raise bad_request(str(error), "messages") from None
        last = params.messages[-1].get("content") if isinstance(params.messages[-1], Mapping) else None
        if isinstance(last, list):
            last = "\n".join(p.get("text", "") for p in last if isinstance(p, Mapping))
        echo_source = self.tokenizer.encode_text(last) if isinstance(last, str) and last else []
        return self.tokenizer.encode(text), echo_source

    def submit(
        self,
        *,
        request_id: str,
        model: str,
        prompts: Sequence[tuple[Sequence[int], Sequence[int]]],
        sampling: SamplingParams,
        adapter: LoraAdapter | None,
        param: str,
        kv_transfer: KVTransferParams | None = None,
    ) -> Submission:
        """Start every choice of a request: ``prompts`` are (prompt ids, echo source ids). Raises
        ``OpenAIError``: 400 for a context-window overflow or a request that can never fit in the
        KV cache, 429 when the waiting queue is full, 503 while sleeping. Nothing is left running
        when it raises.

        ``kv_transfer``: with ``do_remote_decode`` each choice is a prefill for another pod, one
        token (the first the request would produce) and the finish reason ``remote_decode``; with
        ``do_remote_prefill`` the prompts' KV is loaded (the ``remote_*`` fields are not needed:
        nothing is really read from the prefill pod)."""
        remote_decode = kv_transfer is not None and kv_transfer.do_remote_decode
        remote_prefill = kv_transfer is not None and kv_transfer.do_remote_prefill
        output_sampling = replace(sampling, max_tokens=1) if remote_decode else sampling
        limit = self.config.engine.max_model_len
        for prompt_ids, _ in prompts:
            if not prompt_ids:
                raise bad_request("the prompt has no tokens", param)
            if len(prompt_ids) + (sampling.max_tokens or 1) > limit:
                raise context_length_exceeded(
                    max_model_len=limit,
                    prompt_tokens=len(prompt_ids),
                    max_tokens=sampling.max_tokens,
                    param=param,
                )
        engine = min(self.engines, key=lambda e: e.num_running + e.num_waiting)
        submission = Submission(
            request_id=request_id, model=model, created=int(time.time()), choices=[], kv_transfer=kv_transfer
        )
        try:
            for p, (prompt_ids, echo_source) in enumerate(prompts):
                submission.prompt_tokens.append(len(prompt_ids))
                for j in range(sampling.n):
                    output = self._output(
                        prompt_ids, echo_source, output_sampling, j, limit - len(prompt_ids)
                    )
                    request = EngineRequest(
                        request_id=f"{request_id}-{p}-{j}",
                        prompt_ids=tuple(prompt_ids),
                        output_ids=output.token_ids,
                        finish_reason=REMOTE_DECODE if remote_decode else output.finish_reason,
                        lora_name=adapter.name if adapter else None,
                        lora_id=adapter.lora_id if adapter else None,
                        remote_prefill=remote_prefill,
                    )
                    state = engine.submit(request)
                    texts = self.tokenizer.texts(output.token_ids)
                    submission.choices.append(Choice(len(submission.choices), p, engine, state, texts))
        except BaseException as error:
            for choice in submission.choices:
                engine.abort(choice.state)
            if isinstance(error, QueueFull):
                raise queue_full(str(error)) from None
            if isinstance(error, RequestTooLarge):
                raise bad_request(str(error), "max_tokens") from None
            if isinstance(error, EngineSleeping):
                raise OpenAIError(503, str(error), type="server_error", code="sleeping") from None
            raise
        return submission

    def kv_transfer_answer(
        self, submission: Submission, *, host: str | None, port: int | None
    ) -> dict[str, Any] | None:
        """The top-level ``kv_transfer_params`` of a finished prefill's answer, which its decode
        request carries (vLLM NixlConnector's ``request_finished``); ``None`` unless the request
        asked ``do_remote_decode``. As vLLM answers a batch, the first prompt's: the engine (the
        index's name of the rank, ``ingest.applier.holder_id``), its blocks (one list per KV-cache
        group, vLLM >= 0.11's shape: here one group), the pod's address (``host``, ``port``: where
        the request reached it) and the prompt tokens it had cached."""
        kv = submission.kv_transfer
        if kv is None or not kv.do_remote_decode or not submission.choices:
            return None
        first = submission.choices[0]
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(first.state.blocks)],
            "remote_engine_id": holder_id(self.config.pod_id, self.engines.index(first.engine)),
            "remote_request_id": submission.request_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
            "remote_prefill_cached_tokens": first.state.cached_tokens,
        }

    def _output(
        self,
        prompt_ids: Sequence[int],
        echo_source: Sequence[int],
        sampling: SamplingParams,
        index: int,
        limit: int,
    ) -> Output:
        if self.config.output_mode == "echo":
            return echo_output(
                echo_source,
                max_tokens=sampling.max_tokens,
                ignore_eos=sampling.ignore_eos,
                limit=limit,
                fallback=self._fallback_echo,
            )
        rng = request_rng(self.config.seed, prompt_ids, index, sampling.seed)
        return random_output(
            self.tokenizer.encode_text,
            rng,
            max_tokens=sampling.max_tokens,
            ignore_eos=sampling.ignore_eos,
            limit=limit,
        )

    async def run(self, submission: Submission) -> AsyncIterator[tuple[Choice, int]]:
        """Yield (choice, token index) as the tokens are produced, choices interleaved. Closing the
        iterator early aborts whatever is still running; use it with ``contextlib.aclosing``."""
        if len(submission.choices) == 1:
            choice = submission.choices[0]
            async with contextlib.aclosing(choice.engine.generate(choice.state)) as tokens:
                async for index in tokens:
                    yield choice, index
            return
        queue: asyncio.Queue[tuple[Choice, int | None]] = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async with contextlib.aclosing(choice.engine.generate(choice.state)) as tokens:
                    async for index in tokens:
                        queue.put_nowait((choice, index))
            finally:
                queue.put_nowait((choice, None))

        tasks = [asyncio.create_task(pump(choice)) for choice in submission.choices]
        try:
            remaining = len(tasks)
            while remaining:
                choice, index = await queue.get()
                if index is None:
                    remaining -= 1
                else:
                    yield choice, index
            await asyncio.gather(*tasks)  # re-raises what a pump raised, if anything
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for choice in submission.choices:
                # A pump cancelled before it started never entered generate(): abort it here.
                choice.engine.abort(choice.state)
