"""The shared-prefix workload: deterministic, shared prefixes where promised, turns in order."""

from __future__ import annotations

import re
from itertools import islice

import pytest

from simulator.loadgen.workload import (
    Conversation,
    WorkloadSpec,
    answer_suffix,
    completion_body,
    flat_prompt,
    pass_order,
    score_query,
    system_prompt,
    turn_stream,
    user_message,
)

SPEC = WorkloadSpec(groups=3, system_prompt_tokens=1500, questions_per_group=4, turns=3, seed=7)


def approx_tokens(text: str) -> int:
    return len(re.findall(r"\w+|[^\w\s]", text))


def test_same_seed_same_requests():
    assert list(islice(turn_stream(SPEC), 60)) == list(islice(turn_stream(SPEC), 60))
    assert system_prompt(SPEC, 1) == system_prompt(WorkloadSpec(**{**vars(SPEC)}), 1)


def test_another_seed_other_requests():
    other = WorkloadSpec(**{**vars(SPEC), "seed": 8})
    assert system_prompt(SPEC, 0) != system_prompt(other, 0)
    assert [t.user for t in islice(turn_stream(SPEC), 10)] != [t.user for t in islice(turn_stream(other), 10)]


def test_a_group_shares_one_system_prompt_and_groups_differ_from_the_start():
    prompts = [system_prompt(SPEC, g) for g in range(SPEC.groups)]
    assert len(set(prompts)) == SPEC.groups
    # Different within the first block's worth of text (16 tokens is > 40 characters here).
    assert len({p[:40] for p in prompts}) == SPEC.groups
    turns = list(islice(turn_stream(SPEC), SPEC.requests_per_pass))
    for turn in turns:
        conversation = Conversation(system_prompt(SPEC, turn.group))
        assert conversation.prompt(turn.user).startswith(prompts[turn.group])
        assert conversation.messages(turn.user)[0] == {"role": "system", "content": prompts[turn.group]}


@pytest.mark.parametrize("tokens", [200, 2000, 5000])
def test_system_prompt_is_about_the_asked_length(tokens):
    spec = WorkloadSpec(system_prompt_tokens=tokens)
    assert approx_tokens(system_prompt(spec, 0)) == pytest.approx(tokens, rel=0.1)


def test_every_question_is_distinct():
    users = [user_message(SPEC, g, q, t) for g in range(3) for q in range(4) for t in range(3)]
    assert len(set(users)) == len(users)
    assert user_message(SPEC, 2, 1, 0).startswith("Question 1 of group 2: ")
    assert user_message(SPEC, 2, 1, 2).startswith("Follow-up 2: ")


def test_a_pass_sends_every_turn_once_in_session_order_with_bounded_interleaving():
    spec = WorkloadSpec(groups=3, questions_per_group=4, turns=3, seed=7, active_sessions=2)
    order = pass_order(spec)
    assert sorted(order) == [(g, q, t) for g in range(3) for q in range(4) for t in range(3)]
    next_turn: dict[tuple[int, int], int] = {}
    open_sessions: set[tuple[int, int]] = set()
    for group, question, turn in order:
        assert next_turn.get((group, question), 0) == turn
        next_turn[group, question] = turn + 1
        open_sessions.add((group, question))
        assert len(open_sessions) <= 2
        if turn == 2:
            open_sessions.discard((group, question))


def test_single_turn_pass_is_a_shuffle_of_all_questions():
    spec = WorkloadSpec(groups=4, questions_per_group=5, seed=1)
    order = pass_order(spec)
    assert sorted(order) == [(g, q, 0) for g in range(4) for q in range(5)]
    assert order != sorted(order)
    assert {g for g, _, _ in order[:8]} != {0}  # groups are interleaved, not sent one after another


def test_the_stream_repeats_the_pass_with_fresh_sessions():
    n = SPEC.requests_per_pass
    first, second = list(islice(turn_stream(SPEC), 2 * n))[:n], list(islice(turn_stream(SPEC), 2 * n))[n:]
    assert [t.seq for t in first + second] == list(range(2 * n))
    assert [(t.group, t.question, t.turn, t.user) for t in first] == [
        (t.group, t.question, t.turn, t.user) for t in second
    ]
    assert {t.session.split("-")[0] for t in first} == {"p0"}
    assert {t.session.split("-")[0] for t in second} == {"p1"}
    assert [t.last for t in first] == [t.turn == 2 for t in first]


def test_a_turn_extends_the_previous_turn_and_its_answer():
    conversation = Conversation("You are helpful.")
    first_prompt, first_messages = conversation.prompt("Q1?"), conversation.messages("Q1?")
    conversation.record("Q1?", " A1.")
    second_prompt, second_messages = conversation.prompt("Q2?"), conversation.messages("Q2?")
    assert second_prompt.startswith(first_prompt + " A1.")
    assert second_prompt.endswith("\n\nUser: Q2?\nAssistant:")
    assert second_messages[: len(first_messages)] == first_messages
    assert second_messages[len(first_messages) :] == [
        {"role": "assistant", "content": " A1."},
        {"role": "user", "content": "Q2?"},
    ]
    for chat in (True, False):
        before = completion_body(
            model="m", max_tokens=8, chat=chat, conversation=Conversation("S"), user="Q1?"
        )
        after_conversation = Conversation("S", [("Q1?", " A1.")])
        after = completion_body(
            model="m", max_tokens=8, chat=chat, conversation=after_conversation, user="Q2?"
        )
        assert flat_prompt(after).startswith(flat_prompt(before) + answer_suffix(before, " A1."))


def test_request_and_score_bodies():
    conversation = Conversation("S")
    chat = completion_body(model="m", max_tokens=8, chat=True, conversation=conversation, user="Q?")
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["max_tokens"] == 8 and chat["messages"][-1] == {"role": "user", "content": "Q?"}
    assert score_query(chat, ["sim-0"]) == {"model": "m", "pods": ["sim-0"], "messages": chat["messages"]}
    plain = completion_body(model="m", max_tokens=8, chat=False, conversation=conversation, user="Q?")
    assert "messages" not in plain
    assert score_query(plain, ["sim-0"]) == {
        "model": "m",
        "pods": ["sim-0"],
        "prompt": "S\n\nUser: Q?\nAssistant:",
    }


def test_invalid_specs_are_refused():
    with pytest.raises(ValueError, match="groups"):
        WorkloadSpec(groups=0)
    with pytest.raises(ValueError, match="turns"):
        WorkloadSpec(turns=0)
