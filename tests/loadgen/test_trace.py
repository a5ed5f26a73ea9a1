"""Trace replay: reading Mooncake's format and ours, prompts from hash ids, pacing, windows."""

from __future__ import annotations

import json
import math
import os

import pytest

from simulator.loadgen.trace import (
    PromptBuilder,
    TraceError,
    TraceRequest,
    TraceSpec,
    arrivals,
    block_reuse,
    load_trace,
    load_window,
    own_rate,
)


def write_trace(path, lines: list[dict | str]) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def mooncake(ms: int, ids: list[int], input_length: int | None = None, output: int = 100) -> dict:
    length = input_length if input_length is not None else 512 * len(ids)
    return {"timestamp": ms, "input_length": length, "output_length": output, "hash_ids": ids}


def test_a_mooncake_trace_is_read_in_arrival_order(tmp_path):
    path = write_trace(
        tmp_path / "t.jsonl", [mooncake(2000, [0, 2]), "", mooncake(0, [0, 1]), mooncake(0, [3])]
    )
    requests = load_trace(path)
    assert [(r.line, r.at, r.hash_ids) for r in requests] == [
        (3, 0.0, (0, 1)),
        (4, 0.0, (3,)),
        (1, 2.0, (0, 2)),
    ]
    assert requests[0] == TraceRequest(line=3, at=0.0, input_tokens=1024, output_tokens=100, hash_ids=(0, 1))


def test_our_minimal_format_takes_a_prompt_or_a_token_count(tmp_path):
    path = write_trace(
        tmp_path / "t.jsonl",
        [{"timestamp": 0, "prompt": "Say hello to the fleet"}, {"timestamp": 500, "input_length": 40}],
    )
    first, second = load_trace(path)
    assert first.prompt == "Say hello to the fleet" and first.output_tokens is None
    assert second.prompt is None and second.hash_ids == () and second.input_tokens == 40
    builder = PromptBuilder(TraceSpec(path))
    assert builder.prompt(first) == "Say hello to the fleet"
    assert builder.output_tokens(first, default=7) == 7


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "t.jsonl:2: not JSON"),
        ("[1, 2]", "t.jsonl:2: expected a JSON object"),
        ('{"input_length": 5}', "t.jsonl:2: no 'timestamp'"),
        ('{"timestamp": -1, "input_length": 5}', "'timestamp' must be a number >= 0"),
        ('{"timestamp": 0}', "t.jsonl:2: no 'input_length'"),
        ('{"timestamp": 0, "input_length": 0}', "'input_length' must be at least 1 token"),
        (
            '{"timestamp": 0, "input_length": 5, "hash_ids": [1, "x"]}',
            "'hash_ids' must be a list of integers",
        ),
        ('{"timestamp": 0, "prompt": "hi", "input_length": 5}', "give 'prompt', or 'input_length'"),
        ('{"timestamp": 0, "prompt": ""}', "'prompt' must be non-empty text"),
        ('{"timestamp": "soon", "input_length": 5}', "'timestamp' must be a number"),
    ],
)
def test_a_bad_line_is_refused_with_its_number(tmp_path, line, message):
    path = write_trace(tmp_path / "t.jsonl", [mooncake(0, [0]), line])
    with pytest.raises(TraceError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_trace(path)


def test_an_empty_or_missing_trace_is_refused(tmp_path):
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write_trace(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(TraceError, match="No such file"):
        load_trace(tmp_path / "absent.jsonl")


def test_shared_hash_ids_give_shared_prompt_prefixes(tmp_path):
    path = write_trace(
        tmp_path / "t.jsonl", [mooncake(0, [0, 1, 2]), mooncake(10, [0, 1, 3]), mooncake(20, [4, 1])]
    )
    a, b, c = load_trace(path)
    builder = PromptBuilder(TraceSpec(path, tokens_per_block=16))
    pa, pb, pc = (builder.prompt(r) for r in (a, b, c))
    shared = builder.chunk(0) + builder.chunk(1)
    assert pa.startswith(shared) and pb.startswith(shared)
    assert pa[len(shared) :] != pb[len(shared) :]
    assert not pc.startswith(builder.chunk(0)[:20])  # another first block: nothing shared
    # The same ids give the same text in another run (another builder, the same seed).
    assert PromptBuilder(TraceSpec(path, tokens_per_block=16)).prompt(a) == pa
    assert PromptBuilder(TraceSpec(path, tokens_per_block=16), seed=1).prompt(a) != pa


def count_tokens(text: str) -> int:
    """The trace module's own approximation: a word or a full stop is a token."""
    return sum(1 + word.endswith(".") for word in text.split())


def test_prompts_are_scaled_to_the_tokens_per_block_and_a_partial_last_block_is_cut(tmp_path):
    # 2.5 blocks of 512 tokens, sent at 32 tokens per block: about 80 tokens.
    path = write_trace(tmp_path / "t.jsonl", [mooncake(0, [7, 8, 9], input_length=1280)])
    (request,) = load_trace(path)
    builder = PromptBuilder(TraceSpec(path, tokens_per_block=32))
    prompt = builder.prompt(request)
    assert prompt.startswith(builder.chunk(7) + builder.chunk(8))
    assert builder.chunk(9).startswith(prompt[len(builder.chunk(7) + builder.chunk(8)) :].rstrip())
    assert 70 <= count_tokens(prompt) <= 82


def test_requests_without_hash_ids_get_prompts_of_their_own(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 300}] * 2)
    a, b = load_trace(path)
    builder = PromptBuilder(TraceSpec(path, block_size=1))
    pa, pb = builder.prompt(a), builder.prompt(b)
    assert pa != pb and pa[:10] != pb[:10]
    assert 280 <= count_tokens(pa) <= 302


def test_output_lengths_are_scaled_and_capped(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [mooncake(0, [0], output=500), mooncake(0, [1], output=3)])
    long, short = load_trace(path)
    spec = TraceSpec(path, output_scale=0.1, max_output_tokens=32)
    builder = PromptBuilder(spec)
    assert builder.output_tokens(long, default=64) == 32
    assert builder.output_tokens(short, default=64) == 1  # never 0 tokens


def test_pacing_keeps_the_traces_gaps_or_scales_them_all_alike(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [mooncake(0, [0]), mooncake(100, [1]), mooncake(1000, [2])])
    requests = load_trace(path)
    assert own_rate(requests) == pytest.approx(2.0)
    assert arrivals(requests, None) == pytest.approx([0.0, 0.1, 1.0])
    # Twice the rate: every gap halved, so the burst (a gap 9x shorter) stays a burst.
    assert arrivals(requests, 4.0) == pytest.approx([0.0, 0.05, 0.5])
    assert arrivals(requests, math.inf) == [0.0, 0.0, 0.0]


def test_requests_sharing_a_timestamp_are_spread_to_the_next_one_only_when_asked(tmp_path):
    # A coarse clock, as Mooncake's: 3 requests at 0 ms, 1 at 300, 2 at 900 (the last ones).
    stamps = [0, 0, 0, 300, 900, 900]
    path = write_trace(tmp_path / "t.jsonl", [mooncake(ms, [i]) for i, ms in enumerate(stamps)])
    requests = load_trace(path)
    assert arrivals(requests, None) == pytest.approx([0.0, 0.0, 0.0, 0.3, 0.9, 0.9])
    # 3 over the 0.3 s to 300 ms; the last 2 over the median of the gaps 0.3 and 0.6 s (0.45 s).
    spread = arrivals(requests, None, spread_ties=True)
    assert spread == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.9, 1.125])
    assert arrivals(requests, None, spread_ties=True) == spread  # no randomness
    assert own_rate(requests) == pytest.approx(5 / 0.9)
    assert own_rate(requests, spread_ties=True) == pytest.approx(5 / 1.125)  # the last ties lengthen it


def test_spread_ties_then_rescaled_keep_the_mean_rate_asked_for(tmp_path):
    stamps = [0, 0, 0, 0, 3000, 3000, 6000, 6000, 6000, 9000, 9000]  # spread, the last at 10.5 s
    path = write_trace(tmp_path / "t.jsonl", [mooncake(ms, [i]) for i, ms in enumerate(stamps)])
    requests = load_trace(path)
    for qps in (0.5, 2.0, 7.0):
        plain, spread = arrivals(requests, qps), arrivals(requests, qps, spread_ties=True)
        assert (len(plain) - 1) / plain[-1] == pytest.approx(qps)
        assert (len(spread) - 1) / spread[-1] == pytest.approx(qps)
        assert len(set(spread)) == len(spread)  # no two at one instant any more
        assert spread == sorted(spread)
    # Spread first, then every gap scaled alike: the spread times at twice the rate, halved.
    own = arrivals(requests, None, spread_ties=True)
    rate = (len(own) - 1) / own[-1]
    assert arrivals(requests, 2 * rate, spread_ties=True) == pytest.approx([t / 2 for t in own])
    assert arrivals(requests, math.inf, spread_ties=True) == [0.0] * len(stamps)


def test_a_single_tied_group_is_spread_over_the_traces_usual_gap(tmp_path):
    # Distinct timestamps 1 s apart but for a burst of 4 at 1,000 ms: only those 4 move.
    stamps = [0, 1000, 1000, 1000, 1000, 2000, 3000]
    path = write_trace(tmp_path / "t.jsonl", [mooncake(ms, [i]) for i, ms in enumerate(stamps)])
    assert arrivals(load_trace(path), None, spread_ties=True) == pytest.approx(
        [0.0, 1.0, 1.25, 1.5, 1.75, 2.0, 3.0]
    )
    # A burst at the trace's last timestamp: over the median gap between distinct ones (1, 1, 4 s),
    # the usual tick, not the mean (2 s) a long gap inflates.
    stamps = [0, 1000, 2000, 6000, 6000]
    path = write_trace(tmp_path / "t.jsonl", [mooncake(ms, [i]) for i, ms in enumerate(stamps)])
    assert arrivals(load_trace(path), None, spread_ties=True) == pytest.approx([0.0, 1.0, 2.0, 6.0, 6.5])


def test_requests_all_at_one_instant_have_no_gap_to_be_spread_over(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [mooncake(500, [i]) for i in range(3)])
    requests = load_trace(path)
    assert arrivals(requests, None, spread_ties=True) == [0.0, 0.0, 0.0]
    assert arrivals(requests, 4.0, spread_ties=True) == [0.0, 0.0, 0.0]


def test_a_window_starts_into_the_trace_and_its_file_is_read_again_when_it_changes(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [mooncake(0, [0]), mooncake(5000, [1]), mooncake(9000, [2])])
    spec = TraceSpec(path, start=4)
    assert [r.hash_ids for r in load_window(spec)] == [(1,), (2,)]
    write_trace(tmp_path / "t.jsonl", [mooncake(0, [0]), mooncake(4500, [5]), mooncake(9000, [2])])
    os.utime(path, ns=(1, 1))  # a new modification time, however coarse the file system's clock
    assert [r.hash_ids for r in load_window(spec)] == [(5,), (2,)]
    with pytest.raises(TraceError, match="no request at or after 20 s"):
        load_window(TraceSpec(path, start=20))


def test_block_reuse_counts_blocks_an_earlier_request_began_with(tmp_path):
    path = write_trace(
        tmp_path / "t.jsonl",
        [mooncake(0, [0, 1]), mooncake(1, [0, 1, 2]), mooncake(2, [0, 3]), mooncake(3, [4, 1])],
    )
    # [0,1]: none; [0,1,2]: 2; [0,3]: 1; [4,1]: none (1 after another first block is not a prefix)
    assert block_reuse(load_trace(path)) == pytest.approx(3 / 9)
    assert block_reuse([TraceRequest(1, 0.0, 5, None)]) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"tokens_per_block": 0},
        {"output_scale": 0},
        {"max_output_tokens": 0},
        {"start": -1},
    ],
)
def test_a_spec_refuses_sizes_that_cannot_be(kwargs):
    with pytest.raises(ValueError):
        TraceSpec("t.jsonl", **kwargs)
