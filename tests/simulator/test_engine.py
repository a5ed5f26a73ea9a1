"""The engine: cache hits as vLLM counts them, output blocks cached, queueing, refusals, latency."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from ingest.events import BlockStored
from kvindex.keys import block_keys
from simulator.config import EngineConfig, LatencyConfig
from simulator.engine import Engine, EngineRequest, QueueFull, RequestState, RequestTooLarge
from tests.simulator.conftest import ZERO_LATENCY

B = 16


def request(
    prompt: range | list[int], output: range | list[int], name: str = "r", *, remote_prefill: bool = False
) -> EngineRequest:
    return EngineRequest(
        request_id=name, prompt_ids=tuple(prompt), output_ids=tuple(output), remote_prefill=remote_prefill
    )


def engine(batches: list | None = None, latency: LatencyConfig = ZERO_LATENCY, **config: object) -> Engine:
    return Engine(
        config=EngineConfig(**{"hash_seed": "42", "block_size": B, **config}),
        latency=latency,
        on_events=batches.append if batches is not None else None,
    )


async def drain(e: Engine, state: RequestState) -> list[int]:
    async with contextlib.aclosing(e.generate(state)) as tokens:
        return [i async for i in tokens]


def run(e: Engine, *requests: EngineRequest) -> list[RequestState]:
    """Submit and run ``requests`` one after the other."""

    async def main() -> list[RequestState]:
        states = []
        for r in requests:
            state = e.submit(r)
            await drain(e, state)
            states.append(state)
        return states

    return asyncio.run(main())


def test_a_repeated_prompt_hits_its_full_blocks() -> None:
    first, second = run(engine(), request(range(40), [7]), request(range(40), [7]))
    assert (first.cached_tokens, second.cached_tokens) == (0, 32)


def test_a_fully_cached_prompt_recomputes_its_last_block() -> None:
    # vLLM caps the hit at prompt_tokens - 1 so that at least one token is computed (for the
    # logits); with 32 = 2 blocks fully cached, block 2 is recomputed and 16 tokens are cached.
    batches: list = []
    e = engine(batches)
    first, second = run(e, request(range(32), [7]), request(range(32), [7]))
    assert (first.cached_tokens, second.cached_tokens) == (0, 16)
    stored = [ev for batch in batches for ev in batch if isinstance(ev, BlockStored)]
    assert [ev.block_hashes for ev in stored] == [tuple(block_keys(range(32), seed="42"))]  # no duplicate


def test_prompt_and_generated_blocks_are_stored_with_their_parents() -> None:
    batches: list = []
    prompt, output = list(range(20)), list(range(500, 530))
    (state,) = run(engine(batches), request(prompt, output))
    keys = block_keys(prompt + output[:-1], seed="42")  # the last output token has no KV
    assert len(keys) == 3
    stored = [ev for batch in batches for ev in batch if isinstance(ev, BlockStored)]
    assert [(ev.block_hashes, ev.parent_block_hash) for ev in stored] == [
        ((keys[0],), None),  # at admission: the prompt's one full block
        ((keys[1],), keys[0]),  # filled while decoding
        ((keys[2],), keys[1]),
    ]
    assert stored[1].token_ids == tuple((prompt + output)[16:32])
    assert all(ev.block_size == B and ev.tier == "gpu" for ev in stored)
    assert state.generated == 30


def test_a_next_turn_reuses_the_generated_blocks() -> None:
    prompt, output, question = list(range(20)), list(range(500, 530)), list(range(900, 910))
    _, turn2 = run(engine(), request(prompt, output), request(prompt + output + question, [1]))
    assert turn2.cached_tokens == 48


def test_each_step_is_one_batch() -> None:
    batches: list = []
    run(engine(batches), request(range(20), range(500, 530)))
    assert len(batches) == 3  # admission, then two decode steps that filled a block
    assert all(len(batch) == 1 for batch in batches)


def test_kv_exhaustion_makes_requests_wait_not_fail() -> None:
    # 3 blocks; each request needs 2 (16 + 8 tokens): the second waits for the first to finish.
    e = engine(kv_cache_size=3)

    async def main() -> tuple[str, list[int], list[int]]:
        a = e.submit(request(range(16), range(8), "a"))
        b = e.submit(request(range(100, 116), range(8), "b"))
        status = b.status
        tokens = await asyncio.gather(drain(e, a), drain(e, b))
        return status, *tokens

    status, a_tokens, b_tokens = asyncio.run(main())
    assert status == "waiting"
    assert a_tokens == b_tokens == list(range(8))


def test_a_request_larger_than_the_cache_is_refused_at_once() -> None:
    e = engine(kv_cache_size=2)
    with pytest.raises(RequestTooLarge, match=r"needs 3 KV-cache blocks .* only 2"):
        e.submit(request(range(40), [1]))
    assert e.num_waiting == 0


def test_a_full_waiting_queue_refuses() -> None:
    async def main() -> None:
        e = engine(max_num_seqs=1, max_waiting=1)
        a = e.submit(request(range(20), [1], "a"))
        b = e.submit(request(range(20), [1], "b"))
        assert (a.status, b.status) == ("running", "waiting")
        with pytest.raises(QueueFull, match="waiting queue is full"):
            e.submit(request(range(20), [1], "c"))
        assert e.num_waiting == 1
        await asyncio.gather(drain(e, a), drain(e, b))
        assert e.num_running == e.num_waiting == 0

    asyncio.run(main())


def test_no_waiting_room_refuses_anything_that_cannot_run_now() -> None:
    e = engine(max_num_seqs=1, max_waiting=0)
    e.submit(request(range(20), [1], "a"))
    with pytest.raises(QueueFull):
        e.submit(request(range(20), [1], "b"))


def test_an_aborted_request_frees_its_blocks_and_lets_the_next_run() -> None:
    async def main() -> None:
        e = engine(max_num_seqs=1)
        a = e.submit(request(range(20), range(10), "a"))
        b = e.submit(request(range(20), range(10), "b"))
        async with contextlib.aclosing(e.generate(a)) as tokens:
            async for _ in tokens:
                break  # the client went away after one token
        assert (a.status, a.finish_reason) == ("finished", "abort")
        assert b.status == "running"
        assert await drain(e, b) == list(range(10))
        assert e.cache.num_used == 0

    asyncio.run(main())


class VirtualTime:
    """A clock that only moves when a request sleeps (one request at a time)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay


def test_cached_tokens_cut_the_time_to_first_token() -> None:
    time = VirtualTime()
    latency = LatencyConfig(prefill_overhead_ms=10, prefill_time_per_token_ms=1, inter_token_latency_ms=2)
    e = Engine(
        config=EngineConfig(hash_seed="42", block_size=B),
        latency=latency,
        clock=time.clock,
        sleep=time.sleep,
    )
    cold, warm = run(e, request(range(40), range(3)), request(range(40), range(3)))
    assert cold.first_token_at - cold.admitted_at == pytest.approx(0.010 + 40 * 0.001)
    assert warm.first_token_at - warm.admitted_at == pytest.approx(0.010 + 8 * 0.001)
    assert time.sleeps[1:3] == [pytest.approx(0.002)] * 2  # inter-token latency


def test_a_hit_on_blocks_still_being_prefilled_waits_for_them() -> None:
    time = VirtualTime()
    latency = LatencyConfig(prefill_overhead_ms=1, prefill_time_per_token_ms=1, inter_token_latency_ms=0)
    e = Engine(
        config=EngineConfig(hash_seed="42", block_size=B), latency=latency, clock=time.clock, sleep=time.sleep
    )
    a = e.submit(request(range(64), [1], "a"))
    b = e.submit(request(range(64), [1], "b"))
    assert b.cached_tokens == 48
    assert a.first_token_at == pytest.approx(100 + 0.001 + 0.064)
    # b cannot start before a's blocks exist, then computes its own 16 tokens.
    assert b.first_token_at == pytest.approx(a.first_token_at + 0.001 + 0.016)


# --- a prompt prefilled by another pod (P/D disaggregation) ----------------------------------------


def virtual_engine(time: VirtualTime, latency: LatencyConfig, batches: list | None = None) -> Engine:
    return Engine(
        config=EngineConfig(hash_seed="42", block_size=B),
        latency=latency,
        on_events=batches.append if batches is not None else None,
        clock=time.clock,
        sleep=time.sleep,
    )


TRANSFER = LatencyConfig(
    prefill_overhead_ms=50,
    prefill_time_per_token_ms=10,
    inter_token_latency_ms=2,
    kv_cache_transfer_latency_ms=3,
    kv_cache_transfer_time_per_token_ms=0.5,
)


def test_a_remote_prefill_waits_for_the_transfer_of_its_prompt_instead_of_prefilling_it() -> None:
    time = VirtualTime()
    (state,) = run(virtual_engine(time, TRANSFER), request(range(40), range(3), remote_prefill=True))
    assert (state.cached_tokens, state.transferred_tokens) == (0, 40)
    assert state.transfer_time == pytest.approx(0.003 + 40 * 0.0005)
    assert state.first_token_at - state.admitted_at == pytest.approx(state.transfer_time)
    assert state.generated == 3


def test_a_remote_prefill_transfers_only_what_it_does_not_hold_already() -> None:
    time = VirtualTime()
    e = virtual_engine(time, TRANSFER)
    _, decode = run(e, request(range(40), [7]), request(range(40), range(3), remote_prefill=True))
    # vLLM's NixlConnector loads the prompt tokens beyond the local prefix hit (2 blocks of 16).
    assert (decode.cached_tokens, decode.transferred_tokens) == (32, 8)
    assert decode.first_token_at - decode.admitted_at == pytest.approx(0.003 + 8 * 0.0005)


def test_transferred_blocks_are_stored_when_they_arrive() -> None:
    batches: list = []
    time = VirtualTime()
    e = virtual_engine(time, TRANSFER, batches)
    prompt = list(range(40))

    async def main() -> tuple[list, list]:
        state = e.submit(request(prompt, range(3), remote_prefill=True))
        at_admission = list(batches)
        await drain(e, state)
        return at_admission, batches

    at_admission, after = asyncio.run(main())
    assert at_admission == []  # nothing is cached before the KV has arrived (vLLM: delay_cache_blocks)
    (stored,) = [ev for batch in after for ev in batch if isinstance(ev, BlockStored)]
    assert stored.block_hashes == tuple(block_keys(prompt, seed="42"))
    assert stored.token_ids == tuple(prompt[:32])
    # and the next request hits them
    (again,) = run(e, request(prompt, [1]))
    assert again.cached_tokens == 32


def test_a_remote_prefill_tells_the_observer_its_transfer() -> None:
    seen: list[tuple[str, float]] = []

    class Observer:
        def request_admitted(self, state: RequestState) -> None:
            seen.append(("admitted", state.transferred_tokens))

        def kv_transferred(self, state: RequestState, seconds: float) -> None:
            seen.append(("transferred", seconds))

        def first_token(self, state: RequestState, ttft: float) -> None:
            seen.append(("first token", ttft))

        def next_token(self, state: RequestState, itl: float) -> None:
            pass

        def request_finished(self, state: RequestState, e2e: float) -> None:
            pass

    time = VirtualTime()
    e = Engine(
        config=EngineConfig(hash_seed="42", block_size=B),
        latency=TRANSFER,
        observer=Observer(),
        clock=time.clock,
        sleep=time.sleep,
    )
    run(e, request(range(20), [1]), request(range(100, 120), [1], remote_prefill=True))
    assert seen == [
        ("admitted", 0),
        ("first token", pytest.approx(0.050 + 20 * 0.010)),
        ("admitted", 20),
        ("transferred", pytest.approx(0.003 + 20 * 0.0005)),
        ("first token", pytest.approx(0.003 + 20 * 0.0005)),
    ]


@pytest.mark.parametrize(("interference", "itl"), [(0.0, 0.002), (0.5, 0.003)])
def test_a_prompt_being_computed_slows_the_engines_decoding(interference: float, itl: float) -> None:
    """Chunked prefill: while b computes its prompt, every token a decodes takes 1 + interference
    times longer; c, whose prompt is being transferred from a prefill pod, computes nothing."""
    time = VirtualTime()
    latency = LatencyConfig(
        prefill_overhead_ms=0,
        prefill_time_per_token_ms=10,
        inter_token_latency_ms=2,
        prefill_interference=interference,
    )
    e = virtual_engine(time, latency)

    async def main() -> None:
        a = e.submit(request(range(1), range(3), "a"))
        e.submit(request(range(1000, 1100), [1], "b"))  # 100 tokens: 1 s of prefill
        e.submit(request(range(2000, 2100), [1], "c", remote_prefill=True))
        await drain(e, a)

    asyncio.run(main())
    assert time.sleeps == [pytest.approx(0.010), pytest.approx(itl), pytest.approx(itl)]
