"""A pod's ``/metrics`` read as untrusted input: counts, or a reason; never another exception,
never more than the bounds, whatever the bytes and however they are cut into chunks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from registry.pod_metrics import (
    MAX_LINE_BYTES,
    MAX_REQUESTS,
    PodMetricsError,
    RequestsReader,
    requests_by_state,
)

METRICS = b"""# HELP vllm:num_requests_running Running.
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="odd } name \\" here"} 1 1712345678000
vllm:num_requests_waiting{engine="0",model_name="m"} 2e0\r
vllm:num_requests_waiting_by_reason{reason="x"} -9.0
vllm:num_requests_swapped NaN
"""


def read(body: bytes, size: int) -> tuple[float, float]:
    reader = RequestsReader()
    for start in range(0, len(body), size):
        reader.feed(body[start : start + size])
    return reader.counts()


def test_counts_are_summed_over_label_sets_whatever_the_chunks():
    assert requests_by_state(METRICS) == (4.0, 2.0)
    for size in (1, 2, 5, 17, 64, 4096):
        assert read(METRICS, size) == (4.0, 2.0)
    assert requests_by_state(b"") == (0.0, 0.0)


@pytest.mark.parametrize(
    "value",
    [b"1.2.3", b"NaN", b"+Inf", b"-Inf", b"-1", b"1e999", b"2e6", b"1_000", b"0x10", b"\xff\xfe", b""],
)
def test_a_value_that_is_not_a_count_is_malformed(value):
    with pytest.raises(PodMetricsError) as raised:
        requests_by_state(b"vllm:num_requests_running " + value + b"\n")
    assert raised.value.reason == "malformed"
    assert requests_by_state(b"vllm:num_requests_waiting %d\n" % MAX_REQUESTS) == (0.0, MAX_REQUESTS)


def test_size_is_bounded_and_long_lines_are_skipped_unless_ours():
    reader = RequestsReader(max_bytes=1000)
    reader.feed(b"#" * 1000)
    with pytest.raises(PodMetricsError, match="over 1000 bytes") as raised:
        reader.feed(b"#")
    assert raised.value.reason == "too_large"
    long = b"# " + b"x" * (3 * MAX_LINE_BYTES) + b"\nvllm:num_requests_running 5\n"
    assert read(long, 1000) == (5.0, 0.0)
    with pytest.raises(PodMetricsError, match="line is over"):
        read(b"vllm:num_requests_running{" + b"a" * MAX_LINE_BYTES + b"} 1\n", 1000)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(body=st.binary(max_size=512), cut=st.integers(1, 64), noise=st.sampled_from([b"", b"\n", METRICS]))
def test_any_bytes_give_counts_or_a_reason(body: bytes, cut: int, noise: bytes):
    try:
        running, waiting = read(noise + body + noise, cut)
    except PodMetricsError as error:
        assert error.reason in ("malformed", "too_large")
    else:
        assert running >= 0.0 and waiting >= 0.0
