"""One simulated vLLM engine: a FIFO scheduler over a :class:`~simulator.cache.BlockCache`.

Lifecycle of a request (:class:`EngineRequest` in, :class:`RequestState` out of :meth:`Engine.submit`):

1. **submit** - refused at once when it can never fit in the KV cache (:class:`RequestTooLarge`),
   when the waiting queue is full (:class:`QueueFull`) or while the engine sleeps
   (:class:`EngineSleeping`); otherwise queued.
2. **admission** (a scheduling step, FIFO with head-of-line blocking as vLLM's FCFS policy) - when
   fewer than ``max_num_seqs`` run and the cache can hold the request. Its cached prefix is looked
   up (never the whole prompt: vLLM caps the hit at ``prompt_tokens - 1`` tokens, so that at least
   one token is computed for the logits; with an exact multiple of the block size fully cached,
   the last prompt block is recomputed), it takes references on the hit blocks and fresh blocks for
   everything else (evicting LRU), and the full prompt blocks are stored (a remote prefill's in
   step 3). A request waits for KV room instead of failing.
3. **prefill** - the first token comes ``TTFT`` after admission (``simulator.latency``), and never
   before the blocks it hit are computed by the request that is prefilling them. A request whose
   prompt another pod prefilled (``remote_prefill``) computes nothing: the prompt tokens it did not
   hit are loaded, and its first token comes the transfer time after admission; its prompt blocks
   are stored when they have arrived, with the first token (vLLM caches loaded blocks then).
4. **decode** - one token per inter-token latency; after token ``k`` the sequence has
   ``prompt + k - 1`` computed tokens (the last sampled token has no KV yet, as in vLLM), and each
   block they fill is stored then, so generated tokens are cached for the next turn.
5. **finish** or **abort** - the blocks are released (they stay cached until evicted) and the
   next waiting requests are admitted.

Differences from vLLM, on purpose: all blocks a request can need (``prompt + output - 1`` tokens)
are reserved at admission, so there is no preemption; the output is decided before submission.

Every step that changed the cache hands its events to ``on_events`` as one batch, in order.
Time comes from ``clock``/``sleep`` so tests can run with zero latencies.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ingest.events import Event
from kvindex.keys import block_keys
from simulator.cache import BlockCache
from simulator.config import EngineConfig, LatencyConfig
from simulator.latency import Jitter, inter_token_latency, kv_transfer_time, time_to_first_token

__all__ = [
    "Engine",
    "EngineError",
    "EngineObserver",
    "EngineRequest",
    "EngineSleeping",
    "QueueFull",
    "RequestState",
    "RequestTooLarge",
]


class EngineError(Exception):
    """A request the engine refuses; the message says why."""


class RequestTooLarge(EngineError):
    """The request needs more KV blocks than the whole cache has: it could never run."""


class QueueFull(EngineError):
    """The waiting queue holds ``max_waiting`` requests already."""


class EngineSleeping(EngineError):
    """The engine is asleep (``/sleep``) and takes no request until woken up."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What to run: the prompt's token ids and the output tokens the request will produce (at
    least one), the finish reason to report when they are all out, and the LoRA adapter.
    ``remote_prefill``: another pod prefilled the prompt; its KV is loaded, not computed."""

    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    finish_reason: str = "stop"
    lora_name: str | None = None
    lora_id: int | None = None
    remote_prefill: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt must have at least one token")
        if not self.output_ids:
            raise ValueError("a request produces at least one token")


@dataclass(eq=False, slots=True)
class RequestState:
    """A submitted request as the engine tracks it. ``cached_tokens`` (the prompt tokens hit in
    this engine's cache) is known once admitted, and for a remote prefill ``transferred_tokens``
    (the rest of the prompt, loaded from the prefill pod) and ``transfer_time`` (seconds)."""

    request: EngineRequest
    tokens: tuple[int, ...]  # prompt then output
    keys: list[int]  # keys of every block the computed tokens fill
    num_blocks: int  # blocks reserved at admission
    arrival: float
    status: str = "waiting"  # waiting -> running -> finished
    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    transferred_tokens: int = 0
    transfer_time: float = 0.0
    generated: int = 0
    stored_blocks: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finish_reason: str | None = None
    admitted: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)


class EngineObserver(Protocol):
    """Receives what metrics need; every method is called from the engine's thread."""

    def request_admitted(self, state: RequestState) -> None: ...

    def kv_transferred(self, state: RequestState, seconds: float) -> None: ...

    def first_token(self, state: RequestState, ttft: float) -> None: ...

    def next_token(self, state: RequestState, itl: float) -> None: ...

    def request_finished(self, state: RequestState, e2e: float) -> None: ...


class _NoObserver:
    def request_admitted(self, state: RequestState) -> None:
        pass

    def kv_transferred(self, state: RequestState, seconds: float) -> None:
        pass

    def first_token(self, state: RequestState, ttft: float) -> None:
        pass

    def next_token(self, state: RequestState, itl: float) -> None:
        pass

    def request_finished(self, state: RequestState, e2e: float) -> None:
        pass


class Engine:
    """A scheduler, a block cache and a latency model; single-threaded (one asyncio loop).

    ``latency`` may be replaced at any time: it is read when a latency is computed.
    """

    def __init__(
        self,
        *,
        config: EngineConfig,
        latency: LatencyConfig,
        on_events: Callable[[list[Event]], None] | None = None,
        observer: EngineObserver | None = None,
        seed: int | str = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = config
        self.latency = latency
        self.cache = BlockCache(num_blocks=config.kv_cache_size, block_size=config.block_size)
        self.on_events = on_events
        self.observer: EngineObserver = observer if observer is not None else _NoObserver()
        self.sleeping = False
        self._waiting: deque[RequestState] = deque()
        self._running: list[RequestState] = []
        self._jitter = Jitter(seed)
        self._clock = clock
        self._sleep = sleep

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens of the waiting requests: work queued but not yet holding KV blocks."""
        return sum(state.prompt_tokens for state in self._waiting)

    def running_loras(self) -> set[str]:
        return {s.request.lora_name for s in self._running if s.request.lora_name}

    def waiting_loras(self) -> set[str]:
        return {s.request.lora_name for s in self._waiting if s.request.lora_name}

    def blocks_needed(self, prompt_tokens: int, output_tokens: int) -> int:
        """Blocks reserved for a request: enough for every token that gets KV (all but the last
        output token)."""
        size = self.config.block_size
        return -(-(prompt_tokens + output_tokens - 1) // size)

    # --- submission ------------------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> RequestState:
        """Queue ``request`` and admit what can run. Raises :class:`RequestTooLarge`,
        :class:`QueueFull` or :class:`EngineSleeping`; never blocks."""
        if self.sleeping:
            raise EngineSleeping("the engine is sleeping: POST /wake_up first")
        prompt, output = request.prompt_ids, request.output_ids
        needed = self.blocks_needed(len(prompt), len(output))
        if needed > self.config.kv_cache_size:
            raise RequestTooLarge(
                f"the request needs {needed} KV-cache blocks ({len(prompt)} prompt + {len(output)} "
                f"output tokens, {self.config.block_size} tokens per block) but the cache has only "
                f"{self.config.kv_cache_size}: shorten the prompt or max_tokens"
            )
        tokens = prompt + output
        computed = len(tokens) - 1
        keys = block_keys(
            tokens[:computed],
            seed=self.config.hash_seed,
            block_size=self.config.block_size,
            lora_name=request.lora_name,
        )
        state = RequestState(
            request=request, tokens=tokens, keys=keys, num_blocks=needed, arrival=self._clock()
        )
        self._waiting.append(state)
        self._schedule()
        if state.status == "waiting" and len(self._waiting) > self.config.max_waiting:
            # Admission is FIFO, so a request left waiting is the last one: take it back out.
            self._waiting.pop()
            state.status = "finished"
            raise QueueFull(
                f"the waiting queue is full ({self.config.max_waiting} requests wait for "
                f"{self.config.max_num_seqs} running): retry later"
            )
        return state

    async def generate(self, state: RequestState) -> AsyncIterator[int]:
        """Yield the index of each output token when it is produced. Closing the iterator early
        (or cancelling the task) aborts the request; either way its blocks are released."""
        finished = False
        try:
            await state.admitted.wait()
            await self._sleep_until(state.first_token_at)
            now = self._clock()
            if state.request.remote_prefill:
                self.observer.kv_transferred(state, state.transfer_time)
            self.observer.first_token(state, now - state.arrival)
            planned = max(state.first_token_at, now)
            last = now
            for index in range(len(state.request.output_ids)):
                if index:
                    planned += self._inter_token_latency()
                    await self._sleep_until(planned)
                    now = self._clock()
                    self.observer.next_token(state, now - last)
                    last = now
                state.generated = index + 1
                self._store_computed(state)
                yield index
            finished = True
        finally:
            self._finish(state, state.request.finish_reason if finished else "abort")

    def abort(self, state: RequestState) -> None:
        """Drop a request that will not be iterated (its blocks are released if it was admitted)."""
        self._finish(state, "abort")

    # --- cache management ------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (one ``AllBlocksCleared``) if no request holds blocks."""
        done = self.cache.reset()
        self._flush()
        return done

    def sleep_mode(self) -> bool:
        """Go to sleep (vLLM ``/sleep``): only when idle; the prefix cache is dropped."""
        if self._running or self._waiting:
            return False
        self.cache.reset()
        self._flush()
        self.sleeping = True
        return True

    def wake_up(self) -> None:
        self.sleeping = False

    # --- internals -------------------------------------------------------------------------------

    def _schedule(self) -> None:
        """One scheduling step: admit waiting requests in order while they fit, then flush."""
        size = self.config.block_size
        while self._waiting and len(self._running) < self.config.max_num_seqs:
            head = self._waiting[0]
            # vLLM: max_cache_hit_length = prompt_tokens - 1, in whole blocks.
            hittable = (head.prompt_tokens - 1) // size
            hits = self.cache.cached_prefix(head.keys[:hittable])
            fresh = head.num_blocks - len(hits)
            if not self.cache.can_allocate(hits, fresh):
                break
            self._waiting.popleft()
            self._admit(head, hits, fresh)
        self._flush()

    def _admit(self, state: RequestState, hits: Sequence[int], fresh: int) -> None:
        now = self._clock()
        size = self.config.block_size
        ready = self.cache.ready_at(hits)
        state.blocks = self.cache.allocate(hits, fresh)
        state.cached_tokens = len(hits) * size
        self._running.append(state)
        if state.request.remote_prefill:
            # vLLM's NixlConnector loads only the prompt tokens beyond the local prefix hit.
            state.transferred_tokens = state.prompt_tokens - state.cached_tokens
            transfer = kv_transfer_time(self.latency, transferred_tokens=state.transferred_tokens)
            state.transfer_time = self._jitter.apply(transfer, self.latency.jitter)
            state.first_token_at = max(now, ready) + state.transfer_time
        else:
            ttft = time_to_first_token(
                self.latency,
                prompt_tokens=state.prompt_tokens,
                cached_tokens=state.cached_tokens,
                running=len(self._running),
                max_num_seqs=self.config.max_num_seqs,
            )
            state.first_token_at = max(now, ready) + self._jitter.apply(ttft, self.latency.jitter)
        state.admitted_at = now
        state.status = "running"
        if not state.request.remote_prefill:
            # Loaded blocks are stored once they arrive, with the first token (_store_computed).
            self._store(state, upto=state.prompt_tokens // size, ready_at=state.first_token_at)
        self.observer.request_admitted(state)
        state.admitted.set()

    def _store(self, state: RequestState, *, upto: int, ready_at: float) -> None:
        upto = min(upto, len(state.keys))
        if upto > state.stored_blocks:
            self.cache.store(
                state.blocks,
                state.keys,
                start=state.stored_blocks,
                end=upto,
                token_ids=state.tokens,
                lora_name=state.request.lora_name,
                lora_id=state.request.lora_id,
                ready_at=ready_at,
            )
            state.stored_blocks = upto

    def _store_computed(self, state: RequestState) -> None:
        computed = state.prompt_tokens + state.generated - 1
        before = state.stored_blocks
        self._store(state, upto=computed // self.config.block_size, ready_at=self._clock())
        if state.stored_blocks != before:
            self._flush()

    def _finish(self, state: RequestState, reason: str) -> None:
        if state.status == "finished":
            return
        if state.status == "waiting":
            self._waiting.remove(state)
        else:
            self._running.remove(state)
            self.cache.release(state.blocks)
        state.status = "finished"
        state.finish_reason = reason
        self.observer.request_finished(state, self._clock() - state.arrival)
        self._schedule()

    def _inter_token_latency(self) -> float:
        prefilling = 0
        if self.latency.prefill_interference:
            now = self._clock()
            prefilling = sum(
                1
                for state in self._running
                if not state.request.remote_prefill
                and state.first_token_at is not None
                and state.first_token_at > now
            )
        itl = inter_token_latency(
            self.latency,
            running=len(self._running),
            max_num_seqs=self.config.max_num_seqs,
            prefilling=prefilling,
        )
        return self._jitter.apply(itl, self.latency.jitter)

    async def _sleep_until(self, deadline: float | None) -> None:
        delay = 0.0 if deadline is None else deadline - self._clock()
        # sleep(0) still yields to the loop, so zero-latency requests interleave fairly.
        await self._sleep(max(delay, 0.0))

    def _flush(self) -> None:
        events = self.cache.drain_events()
        if events and self.on_events is not None:
            self.on_events(events)
