"""The router's key memory (``routing.memory.KeyMemory``): per pod, the leading keys it is
remembered to hold, live entries only; checked against the definition on random histories."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.memory import KeyMemory

PODS = ["a", "b", "c"]


def leading_held(memory: KeyMemory, model: str, keys: list[int], *, now: float) -> dict[str, int]:
    """The definition: for each pod that holds the first key, how many keys in a row it holds."""
    out = {}
    for pod in PODS:
        n = 0
        for key in keys:
            until = memory._entries.get((model, key), {}).get(pod)
            if until is None or until <= now:
                break
            n += 1
        if n:
            out[pod] = n
    return out


def test_a_recorded_prefix_is_matched_until_it_expires() -> None:
    memory = KeyMemory(ttl=2.0)
    memory.record("m", [1, 2, 3], "a", now=10.0)
    memory.record("m", [1, 2], "b", now=11.0)

    assert memory.matched("m", [1, 2, 3, 4], now=11.5) == {"a": 3, "b": 2}
    assert memory.matched("m", [1, 2, 3, 4], now=12.5) == {"b": 2}
    assert memory.matched("m", [1, 2, 3, 4], now=13.5) == {}
    assert memory.matched("other", [1, 2], now=11.5) == {}
    assert memory.matched("m", [], now=11.5) == {}


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=12),
            st.sampled_from(PODS),
            st.floats(min_value=0.0, max_value=10.0),
        ),
        max_size=12,
    ),
    st.lists(st.integers(min_value=0, max_value=7), max_size=12),
    st.floats(min_value=0.0, max_value=14.0),
    st.sampled_from([2.0, None]),
)
def test_matched_is_the_leading_run_each_pod_holds(records, keys, now, ttl) -> None:
    memory = KeyMemory(ttl=ttl, max_keys=6)
    for recorded, pod, at in records:
        memory.record("m", recorded, pod, now=at)

    assert memory.matched("m", keys, now=now) == leading_held(memory, "m", keys, now=now)
