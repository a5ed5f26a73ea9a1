"""The shared-prefix workload, generated deterministically from a seed.

``groups`` groups each have a long system prompt (about ``system_prompt_tokens`` tokens of
seeded words); each group has ``questions_per_group`` sessions, each opening with a distinct
question. With ``turns`` > 1 a session is a conversation: turn *t* re-sends everything so far
(system prompt, every earlier question and the answer the pod actually gave) plus a new user
message, so its prompt extends the previous turn's prompt and answer.

One *pass* sends every turn of every session once, in a seeded order that interleaves at most
``active_sessions`` conversations at a time (so a session's next turn comes a while after its
previous one, not back to back). A longer run repeats the pass; repeated sessions start a fresh
conversation. Same spec, same seed -> the same stream of turns, byte for byte.

Sizes are approximate: a word of the word list is counted as one token and so is each
punctuation mark, which is close for the BPE tokenizers of current models.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

# Common English words, all lower case; most are a single token in BPE vocabularies.
_WORD_LIST = """
    able about above across action active actual adapt admit adult advice affect after again
    agent agree ahead allow almost alone along already always amount angle animal answer appear
    apply area argue arrive article artist aspect assume attack attend author avoid aware
    balance basic basis battle beach bear beat become before begin behind believe benefit best
    better between beyond bird black blood board body book border bottom brain branch bread
    break bridge brief bring broad brother budget build burn business buyer cable call camera
    campaign capital card care career carry case catch cause center chain chair chance change
    chapter charge check chief child choice church circle city claim class clear climate clock
    close cloud coach coast code cold collect color column common company compare concept
    concern control cookie corner cost cotton country couple course court cover craft create
    credit crowd culture current customer cycle damage dance dark data daughter deal debate
    decade decide deep defense degree delay demand depend design detail device differ dinner
    direct doctor door double draft drama dream dress drink drive early earth east economy edge
    effect effort eight either element emerge energy engine enjoy enough enter entire equal
    error escape estate event exact example expect expert explain extend face fact factor fair
    fall family farm father fault feature field figure final finger finish fire firm first
    floor focus follow force forest forget form forward frame free friend front fruit full fund
    future game garden gather general gift glass goal gold good grade grass great green ground
    group grow guess guest habit half hand happen hard head health heart heavy help hero high
    history hold home hope horse hotel house human idea image impact income index inside issue
    item join judge jump keep kind kitchen knife labor lake land large later laugh layer lead
    learn leave legal lesson letter level light limit line list listen little local long loss
    machine main major manage market master match matter meal measure media meet member memory
    metal method middle minute mirror model moment money month morning mother motor mountain
    move music name nation nature near network never night noise north note novel number object
    ocean offer office open order other owner page paint paper parent part party pass path
    pattern peace people period person phone piece place plan plant play point policy pool
    power press price print private problem process produce program project proof public quiet
    radio range rate reach reason record region remain report rest result return river road
    rock room round rule safe salt sample scene school science score season second section
    series serve set shape share shell shift short side sign silver simple single sister size
    skill sleep slow small smile social soft soil solid sound source south space speak speed
    spring square staff stage stand start state station step stock stone store story street
    strong student study style subject sugar summer supply system table talent task teacher
    team term test text theory thing third thought title today total tower track trade train
    travel tree trial trouble truth type unit usual valley value video view village visit voice
    wait walk wall water wave weather week weight west wheel window winter wish woman wood word
    work world write year young
"""
WORDS = tuple(_WORD_LIST.split())


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate. ``active_sessions`` 0 means ``4 * groups`` (only matters for turns > 1)."""

    groups: int = 8
    system_prompt_tokens: int = 2000
    questions_per_group: int = 16
    question_tokens: int = 24
    turns: int = 1
    seed: int = 0
    active_sessions: int = 0

    def __post_init__(self) -> None:
        for name in ("groups", "questions_per_group", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.system_prompt_tokens < 0 or self.question_tokens < 1 or self.active_sessions < 0:
            raise ValueError("token counts must be positive and active_sessions >= 0")

    @property
    def sessions_per_pass(self) -> int:
        return self.groups * self.questions_per_group

    @property
    def requests_per_pass(self) -> int:
        return self.sessions_per_pass * self.turns

    @property
    def window(self) -> int:
        return self.active_sessions or 4 * self.groups


@dataclass(frozen=True)
class Turn:
    """One request of the stream: the user message of turn ``turn`` of ``session``.

    ``session`` is unique per pass (``"p<pass>-g<group>-q<question>"``); ``seq`` is the
    position in the stream, from 0.
    """

    seq: int
    session: str
    group: int
    question: int
    turn: int
    user: str
    last: bool


@dataclass
class Conversation:
    """A session so far: its system prompt and the (user, assistant) exchanges that succeeded.

    Rendering guarantees the prefix property multi-turn reuse relies on: the prompt of the next
    turn starts with ``prompt(user) + answer`` of this one (completions), and its messages start
    with ``messages(user)`` plus the assistant answer (chat).
    """

    system: str
    exchanges: list[tuple[str, str]] = field(default_factory=list)

    def messages(self, user: str) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.system}]
        for asked, answered in self.exchanges:
            messages.append({"role": "user", "content": asked})
            messages.append({"role": "assistant", "content": answered})
        messages.append({"role": "user", "content": user})
        return messages

    def prompt(self, user: str) -> str:
        history = "".join(f"\n\nUser: {asked}\nAssistant:{answered}" for asked, answered in self.exchanges)
        return f"{self.system}{history}\n\nUser: {user}\nAssistant:"

    def record(self, user: str, answer: str) -> None:
        self.exchanges.append((user, answer))


def words(rng: random.Random, tokens: int) -> str:
    """Sentences of seeded words, about ``tokens`` tokens (a word or a full stop counts one)."""
    sentences: list[str] = []
    budget = tokens
    while budget > 1:
        length = min(budget - 1, rng.randint(6, 18))
        chosen = [rng.choice(WORDS) for _ in range(length)]
        sentences.append(" ".join(chosen).capitalize() + ".")
        budget -= length + 1
    return " ".join(sentences)


def system_prompt(spec: WorkloadSpec, group: int) -> str:
    """The system prompt every session of ``group`` shares; groups differ from the first block."""
    rng = random.Random(f"{spec.seed}/system/{group}")
    header = f"Group {group} system prompt. You are assistant {group}; answer from the notes below."
    return f"{header}\n\n{words(rng, max(0, spec.system_prompt_tokens - 16))}"


def user_message(spec: WorkloadSpec, group: int, question: int, turn: int) -> str:
    """The user's message in turn ``turn`` of session (group, question); distinct for each."""
    rng = random.Random(f"{spec.seed}/user/{group}/{question}/{turn}")
    lead = f"Question {question} of group {group}" if turn == 0 else f"Follow-up {turn}"
    lead_tokens = 8 if turn == 0 else 4
    return f"{lead}: {words(rng, max(2, spec.question_tokens - lead_tokens))[:-1]}?"


def pass_order(spec: WorkloadSpec) -> list[tuple[int, int, int]]:
    """The (group, question, turn) triples of one pass, in sending order.

    Sessions start in a seeded shuffled order; at most ``spec.window`` are open at a time and
    each step takes the next turn of a seeded random open session, so every session's turns
    stay in order.
    """
    rng = random.Random(f"{spec.seed}/order")
    pending = [(g, q) for g in range(spec.groups) for q in range(spec.questions_per_group)]
    rng.shuffle(pending)
    pending.reverse()  # pop() from the end takes them in shuffled order
    open_sessions: list[list[int]] = []  # [group, question, next turn]
    order: list[tuple[int, int, int]] = []
    while pending or open_sessions:
        while pending and len(open_sessions) < spec.window:
            open_sessions.append([*pending.pop(), 0])
        i = rng.randrange(len(open_sessions))
        group, question, turn = open_sessions[i]
        order.append((group, question, turn))
        if turn + 1 == spec.turns:
            open_sessions.pop(i)
        else:
            open_sessions[i][2] = turn + 1
    return order


def turn_stream(spec: WorkloadSpec) -> Iterator[Turn]:
    """Every turn of the workload, pass after pass, without end."""
    order = pass_order(spec)
    messages = {(g, q, t): user_message(spec, g, q, t) for g, q, t in order}
    seq = 0
    for pass_index in itertools.count():
        for group, question, turn in order:
            yield Turn(
                seq=seq,
                session=f"p{pass_index}-g{group}-q{question}",
                group=group,
                question=question,
                turn=turn,
                user=messages[group, question, turn],
                last=turn + 1 == spec.turns,
            )
            seq += 1


def completion_body(
    *,
    model: str,
    max_tokens: int,
    chat: bool,
    conversation: Conversation,
    user: str,
    stream: bool = True,
) -> dict:
    """The OpenAI request body for one turn of ``conversation`` (see :func:`request_body`)."""
    if chat:
        return request_body(
            model=model, max_tokens=max_tokens, messages=conversation.messages(user), stream=stream
        )
    return request_body(model=model, max_tokens=max_tokens, prompt=conversation.prompt(user), stream=stream)


def request_body(
    *,
    model: str,
    max_tokens: int,
    messages: list[dict[str, str]] | None = None,
    prompt: str | None = None,
    stream: bool = True,
) -> dict:
    """An OpenAI request body with ``messages`` (chat) or a ``prompt`` (completions): streamed
    with a usage chunk (or, ``stream`` False, one JSON answer, which always carries usage),
    ``ignore_eos`` so every answer is ``max_tokens`` long (fair comparisons need equal output
    lengths)."""
    if (messages is None) == (prompt is None):
        raise ValueError("give messages or a prompt")
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    return body


def score_query(body: dict, pods: list[str]) -> dict:
    """The ``/api/v1/score`` request for a completion body: same model and prompt or messages."""
    query = {"model": body["model"], "pods": pods}
    if "messages" in body:
        query["messages"] = body["messages"]
    else:
        query["prompt"] = body["prompt"]
    return query


def flat_prompt(body: dict) -> str:
    """A request's prompt as one string (chat messages joined with role markers), such that
    a later turn's flat prompt starts with ``flat_prompt(body) + answer_suffix(body, answer)``."""
    if "messages" in body:
        return "".join(f"<|{m['role']}|>{m['content']}" for m in body["messages"])
    return body["prompt"]


def answer_suffix(body: dict, answer: str) -> str:
    return f"<|assistant|>{answer}" if "messages" in body else answer
