"""Runs the workload against a fleet: Poisson arrivals, routing, streaming, measuring.

One *step* is one router at one QPS. Every step replays the same workload and, at a given QPS,
the same arrival times (both seeded), so routers are compared on identical traffic. With
``reset_prefix_cache`` each step starts from empty prefix caches (``POST /reset_prefix_cache`` on
every pod, then ``settle`` seconds for the pods' AllBlocksCleared events to reach the index); it
is off by default, as resetting a fleet that serves real traffic throws its cache away. Without
it a step starts from whatever the pods hold, an earlier step's prefixes included.

Per request: wait for the session's previous turn (multi-turn), take a concurrency slot, ask
the scoring service for scores (kv routers need them; for the others they are fetched too,
before sending, to measure how often the chosen pod was the best one), choose the pod, stream
the completion. TTFT and end-to-end latency are measured from sending to the pod, so routing
time (``route_ms`` in the report) is counted separately.

With a *target* (``LoadgenConfig.target``: our gateway, or a peer router) loadgen does not
route: every request goes to the target's OpenAI endpoint, and a step is that target at one QPS,
named by ``label``. The pod that served a request is the one the response names in its
``x-kvcache-pod`` header, unknown without it. The pods, when given, are still what loadgen
resets (when asked) and scrapes (fleet hit rate) and what the observed scores are asked about;
without pods those figures are unknown.

Scores come from ``score_url``. ``manage.py loadgen`` defaults it to the web server of ``make
run`` on this machine, on ``$WEB_PORT`` (:func:`default_score_url`); 8000 is only the fallback.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from urllib.parse import urlsplit

import httpx

from simulator.loadgen.client import fetch_scores, reset_prefix_cache, scrape_fleet, send_completion
from simulator.loadgen.report import PrefixReuse, RequestRecord, StepResult
from simulator.loadgen.routers import (
    DEFAULT_ALPHA,
    InFlight,
    KVRouter,
    RouteRequest,
    ScoreLookup,
    Scores,
    ScoreUnavailable,
    make_router,
)
from simulator.loadgen.trace import PromptBuilder, TraceRequest, TraceSpec, arrivals, load_window, own_rate
from simulator.loadgen.workload import (
    Conversation,
    Turn,
    WorkloadSpec,
    answer_suffix,
    completion_body,
    flat_prompt,
    request_body,
    score_query,
    system_prompt,
    turn_stream,
)

# The scoring API when nothing says where the web server is: `manage.py serve`'s default port.
DEFAULT_SCORE_URL = "http://127.0.0.1:8000/api/v1/score"
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"

Progress = Callable[[RequestRecord], None]
ProgressFactory = Callable[[str, float | None, int | None], AbstractContextManager[Progress | None]]


@dataclass(frozen=True)
class LoadgenConfig:
    """Everything a run needs besides the router, the QPS and its length.

    ``pods`` maps pod id -> base URL (``http://host:port``, no path). ``concurrency`` caps
    requests in flight from loadgen; arrivals beyond it wait (that wait is not in TTFT).
    ``target`` (a base URL, see :func:`parse_target`) sends every request there instead of to a
    pod loadgen chooses; ``pods`` are then optional and ``label`` names the runs (default
    ``target:<url>``). ``replicas`` are more base URLs of the same router (its other replicas):
    request *i* goes to the target for i mod (1 + replicas) = 0, else to that replica, as a
    round-robin load balancer in front of the replicas would send it. ``stream`` False asks for
    one JSON answer per request (no TTFT then).
    ``block_size`` (tokens per KV block) turns a target's ``x-kvcache-matched-blocks`` into
    predicted cached tokens. ``reset_prefix_cache`` empties every pod's prefix cache before each
    step (then waits ``settle`` seconds); off by default, never implied. ``trace`` replays a
    trace file (:mod:`simulator.loadgen.trace`) instead of the generated ``workload``: each
    request with its own prompt and output length (``max_tokens`` when the trace has none).
    """

    pods: dict[str, str] = field(default_factory=dict)
    model: str = DEFAULT_MODEL
    chat: bool = True
    max_tokens: int = 64
    concurrency: int = 256
    seed: int = 0
    score_url: str = DEFAULT_SCORE_URL
    api_key: str | None = None
    score_timeout: float = 5.0
    observe_scores: bool = True
    alpha: float = DEFAULT_ALPHA
    timeout: float = 300.0
    reset_prefix_cache: bool = False
    settle: float = 1.0
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    target: str | None = None
    replicas: tuple[str, ...] = ()
    label: str | None = None
    stream: bool = True
    block_size: int = 16
    trace: TraceSpec | None = None

    def __post_init__(self) -> None:
        if not self.pods and self.target is None:
            raise ValueError("no pods: give a base URL and a pod count, or pods one by one")
        if self.target is not None:
            object.__setattr__(self, "target", parse_target(self.target))  # frozen: normalise once
        if self.replicas and self.target is None:
            raise ValueError("replicas are more URLs of a target: give the target too")
        object.__setattr__(self, "replicas", tuple(parse_target(url) for url in self.replicas))
        if self.label is not None and (self.target is None or not self.label.strip()):
            raise ValueError("a label names a target's runs: give it with a target, not empty")
        if self.concurrency < 1 or self.max_tokens < 1 or self.block_size < 1:
            raise ValueError("concurrency, max_tokens and block_size must be at least 1")

    def describe(self) -> dict:
        """The configuration for a results file (the API key left out)."""
        described = {k: v for k, v in asdict(self).items() if k != "api_key"}
        described["api_key"] = "set" if self.api_key else None
        return described

    @property
    def target_name(self) -> str | None:
        """What reports call a target's runs: the label, else ``target:<url>``; None without one."""
        if self.target is None:
            return None
        return self.label or f"target:{self.target}"

    def endpoint(self, pod: str | None = None, *, seq: int = 0) -> str:
        """The completions URL: the target's (or, for request ``seq``, its replica's) when there
        is one (``pod`` is ignored), else the pod's."""
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        if self.target is not None:
            bases = (self.target, *self.replicas)
            base = bases[seq % len(bases)]
        else:
            base = self.pods[pod]
        return f"{base}{path}"


def default_score_url(environ: Mapping[str, str] = os.environ) -> str:
    """The scoring API of the web server on this machine: ``$WEB_PORT`` (the port ``make run``
    serves the web on) of 127.0.0.1, else :data:`DEFAULT_SCORE_URL`. ValueError when
    ``WEB_PORT`` is set but not a port."""
    port = environ.get("WEB_PORT", "").strip()
    if not port:
        return DEFAULT_SCORE_URL
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"WEB_PORT={port!r} is not a port: set it to the web's port, or give --score-url")
    return f"http://127.0.0.1:{int(port)}/api/v1/score"


def fleet_from_base(base_url: str, count: int) -> dict[str, str]:
    """``sim-<i>`` -> the base URL with its port plus i, for i in 0..count-1."""
    parts = urlsplit(base_url.rstrip("/"))
    if not parts.scheme or not parts.hostname or parts.port is None:
        raise ValueError(f"{base_url!r}: expected scheme://host:port, e.g. http://127.0.0.1:8100")
    if count < 1:
        raise ValueError("the pod count must be at least 1")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return {f"sim-{i}": f"{parts.scheme}://{host}:{parts.port + i}" for i in range(count)}


def parse_pod(option: str) -> tuple[str, str]:
    """``"sim-0=http://127.0.0.1:8100"`` -> (pod, base URL)."""
    pod, sep, url = option.partition("=")
    if not sep or not pod.strip() or not urlsplit(url.strip()).scheme:
        raise ValueError(f"{option!r}: expected POD=URL, e.g. sim-0=http://127.0.0.1:8100")
    return pod.strip(), url.strip().rstrip("/")


def parse_target(option: str) -> str:
    """``"http://127.0.0.1:8200/"`` -> ``"http://127.0.0.1:8200"``: the base URL of an
    OpenAI-compatible server, to which loadgen appends ``/v1/completions`` or
    ``/v1/chat/completions``. A path prefix is kept; one that already ends in ``/v1`` is refused,
    as the endpoint would be ``/v1/v1/...``."""
    url = option.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{option!r}: expected an http(s) base URL, e.g. http://127.0.0.1:8200")
    if parts.query or parts.fragment:
        raise ValueError(f"{option!r}: a target is a base URL, without ?query or #fragment")
    if parts.path.endswith(("/v1", "/completions")):
        raise ValueError(
            f"{option!r}: give the base URL without /v1 (loadgen appends /v1/chat/completions "
            "or /v1/completions)"
        )
    return url


def parse_qps(option: str) -> list[float]:
    """``"2,4,8"`` -> [2.0, 4.0, 8.0]; ``inf`` sends everything at once."""
    try:
        ladder = [float(part) for part in option.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{option!r}: expected QPS values separated by commas, e.g. 2,4,8") from None
    if not ladder or any(not q > 0 for q in ladder):
        raise ValueError(f"{option!r}: every QPS must be > 0")
    return ladder


def arrival_times(seed: int, qps: float) -> Iterator[float]:
    """Seconds from the start of a run at which requests arrive: a Poisson process at ``qps``
    (exponential gaps from a seeded generator); all at 0 for an infinite QPS."""
    rng = random.Random(f"{seed}/arrivals")
    t = 0.0
    while True:
        if not math.isinf(qps):
            t += rng.expovariate(qps)
        yield t


@dataclass
class _Session:
    conversation: Conversation
    previous_done: asyncio.Event | None = None


async def run_step(
    config: LoadgenConfig,
    *,
    router: str | None = None,
    qps: float | None,
    requests: int | None = None,
    duration: float | None = None,
    progress: Progress | None = None,
) -> StepResult:
    """One router (or, with ``config.target``, the target; then no ``router``) at one QPS.
    Stops issuing after ``requests`` requests or ``duration`` seconds (whichever first; one pass
    of the workload, or the whole trace, when neither is given), then waits for the requests in
    flight. A trace is replayed at its own pace with ``qps`` None (the step's QPS is then the
    trace's own mean rate, its ties spread when its spec says so), else with its gaps scaled to
    a mean of ``qps``."""
    if (router is None) == (config.target is None):
        raise ValueError("give a router, or a target in the config, not both or neither")
    trace = load_window(config.trace) if config.trace is not None else None
    if trace is None:
        if qps is None:
            raise ValueError("only a trace has a pace of its own: give a QPS")
        if requests is None and duration is None:
            requests = config.workload.requests_per_pass
        if requests is None and math.isinf(qps):
            raise ValueError("an infinite QPS needs a request count, not a duration")
    limits = httpx.Limits(max_connections=config.concurrency + 2 * len(config.pods) + 8)
    timeout = httpx.Timeout(config.timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        notes: list[str] = []
        if not config.pods:
            notes.append("no pods given: prefix caches not reset, fleet hit rate unknown")
        elif config.reset_prefix_cache:
            refused = await reset_prefix_cache(client, config.pods)
            if refused:
                notes.append(f"prefix cache not reset on {', '.join(refused)}")
            await asyncio.sleep(config.settle)
        else:
            notes.append("prefix caches not reset: the hit rate counts what the pods held before the run")
        before = await scrape_fleet(client, config.pods)
        run = _Run(config, client, router)
        if trace is not None:
            notes.append(_trace_note(config.trace, trace, qps))
            jobs = run.trace_jobs(trace, qps)
            qps = own_rate(trace, spread_ties=config.trace.spread_ties) if qps is None else qps
        else:
            jobs = run.workload_jobs(qps)
        await run.drive(jobs, requests=requests, duration=duration, progress=progress)
        after = await scrape_fleet(client, config.pods)
    silent = [pod for pod in config.pods if before[pod] is None or after[pod] is None]
    if silent:
        notes.append(f"no /metrics from {', '.join(silent)}")
    if run.score_error:
        notes.append(f"last score error: {run.score_error}")
    return StepResult(
        router=run.name,
        qps=qps,
        records=sorted(run.records, key=lambda r: r.seq),
        metrics_before=before,
        metrics_after=after,
        score_calls=run.lookup.calls,
        score_failures=run.lookup.failures,
        fallbacks=run.router.fallbacks if isinstance(run.router, KVRouter) else 0,
        reuse_hit_chars=run.reuse.hit_chars,
        reuse_total_chars=run.reuse.total_chars,
        notes=notes,
        target=config.target,
        block_size=config.block_size,
    )


def _trace_note(spec: TraceSpec, trace: list[TraceRequest], qps: float | None) -> str:
    pace = "at its own pace" if qps is None else f"rescaled to {qps:g} qps"
    if spec.spread_ties:
        pace += ", ties spread over the gap to the next timestamp"
    rate = own_rate(trace, spread_ties=spec.spread_ties)
    return (
        f"trace {spec.path}: {len(trace)} requests from {spec.start:g} s, own rate {rate:.2f} qps, "
        f"replayed {pace}; {spec.block_tokens} tokens per block of {spec.block_size}, "
        f"outputs x {spec.output_scale:g}"
    )


Job = Callable[[], Awaitable[None]]
"""A request of a run, started at its arrival time (what it sends is decided then)."""


class _Run:
    """The state of one step while it runs."""

    def __init__(self, config: LoadgenConfig, client: httpx.AsyncClient, router: str | None) -> None:
        self.config = config
        self.client = client
        self.pods = list(config.pods)
        self.in_flight = InFlight(self.pods)
        self.lookup = ScoreLookup(self._fetch_scores)
        # No router with a target: the target routes, and names the pod in its answer.
        self.router = (
            None
            if router is None
            else make_router(
                router,
                pods=self.pods,
                lookup=self.lookup,
                in_flight=self.in_flight,
                rng=random.Random(f"{config.seed}/router/{router}"),
                alpha=config.alpha,
            )
        )
        self.name = router if router is not None else config.target_name
        # Scores are observed (not needed to route) for non-kv routers, and for a target when
        # there are pods to ask about.
        self.observe = config.observe_scores and not isinstance(self.router, KVRouter) and bool(self.pods)
        self.observe_error: str | None = None
        self.slots = asyncio.Semaphore(config.concurrency)
        self.sessions: dict[str, _Session] = {}
        self.reuse = PrefixReuse()
        self.records: list[RequestRecord] = []
        self.start = 0.0
        self.progress: Progress | None = None
        self._system_prompts: dict[int, str] = {}

    async def _fetch_scores(self, query: dict) -> Scores:
        return await fetch_scores(
            self.client,
            self.config.score_url,
            query,
            api_key=self.config.api_key,
            timeout=self.config.score_timeout,
        )

    async def drive(
        self,
        jobs: Iterator[tuple[float, Job]],
        *,
        requests: int | None,
        duration: float | None,
        progress: Progress | None,
    ) -> None:
        """Starts each job at its time (seconds from now) until ``requests`` were started or
        ``duration`` seconds passed, then waits for all of them."""
        self.progress = progress
        self.start = time.perf_counter()
        tasks = []
        for issued, (at, job) in enumerate(jobs):
            if (requests is not None and issued >= requests) or (duration is not None and at >= duration):
                break
            delay = self.start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(job()))
        await asyncio.gather(*tasks)

    def workload_jobs(self, qps: float) -> Iterator[tuple[float, Job]]:
        """The generated workload's turns, at Poisson arrivals of rate ``qps``."""
        turns = turn_stream(self.config.workload)
        for at in arrival_times(self.config.seed, qps):
            yield at, partial(self._next_turn, turns)

    def trace_jobs(self, trace: list[TraceRequest], qps: float | None) -> Iterator[tuple[float, Job]]:
        """The trace's requests at its own times (``qps`` None) or rescaled to ``qps``, their ties
        spread first when the trace's spec says so."""
        spec = self.config.trace
        builder = PromptBuilder(spec, self.config.seed)
        times = arrivals(trace, qps, spread_ties=spec.spread_ties)
        for seq, (request, at) in enumerate(zip(trace, times, strict=True)):
            yield at, partial(self._replay, seq, request, builder)

    def _next_turn(self, turns: Iterator[Turn]) -> Awaitable[None]:
        """The next turn of the workload, in its session (created on its first turn)."""
        turn = next(turns)
        session = self.sessions.get(turn.session)
        if session is None:
            if turn.group not in self._system_prompts:
                self._system_prompts[turn.group] = system_prompt(self.config.workload, turn.group)
            session = self.sessions[turn.session] = _Session(Conversation(self._system_prompts[turn.group]))
        wait_for, done = session.previous_done, asyncio.Event()
        session.previous_done = done
        return self._one(turn, session, wait_for, done)

    async def _one(
        self, turn: Turn, session: _Session, wait_for: asyncio.Event | None, done: asyncio.Event
    ) -> None:
        config = self.config
        try:
            if wait_for is not None:
                await wait_for.wait()
            body = completion_body(
                model=config.model,
                max_tokens=config.max_tokens,
                chat=config.chat,
                conversation=session.conversation,
                user=turn.user,
                stream=config.stream,
            )
            async with self.slots:
                record, text = await self._send(turn.seq, turn.session, turn.turn, body)
            if record.ok:
                session.conversation.record(turn.user, text)
            self._done(record)
        finally:
            done.set()
            if turn.last:
                self.sessions.pop(turn.session, None)

    async def _replay(self, seq: int, request: TraceRequest, builder: PromptBuilder) -> None:
        config = self.config
        prompt = builder.prompt(request)
        body = request_body(
            model=config.model,
            max_tokens=builder.output_tokens(request, config.max_tokens),
            messages=[{"role": "user", "content": prompt}] if config.chat else None,
            prompt=None if config.chat else prompt,
            stream=config.stream,
        )
        async with self.slots:
            record, _ = await self._send(seq, f"trace-{request.line}", 0, body)
        self._done(record)

    def _done(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self.progress is not None:
            self.progress(record)

    async def _send(self, seq: int, session: str, turn: int, body: dict) -> tuple[RequestRecord, str]:
        """Routes and sends one request; its record and the answer's text."""
        config = self.config
        request = RouteRequest(id=seq, score_query=score_query(body, self.pods))
        routing = time.perf_counter()
        if self.observe:
            try:
                await self.lookup.scores(request)
            except ScoreUnavailable as e:  # counted by the lookup; noted, since no router needs it
                self.observe_error = str(e)
        chosen = await self.router.choose(request) if self.router is not None else None
        scores = self.lookup.known(request)
        self.lookup.forget(request)
        sent = time.perf_counter()
        if chosen is None:  # the target's: our gateway takes the scoring API's keys
            headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
            completion = await send_completion(self.client, config.endpoint(seq=seq), body, headers=headers)
        else:
            self.in_flight.start(chosen)
            try:
                completion = await send_completion(self.client, config.endpoint(chosen), body)
            finally:
                self.in_flight.finish(chosen)
        # Loadgen's choice, else the pod the target named (None: unknown).
        pod = chosen if chosen is not None else completion.pod
        if completion.ok:
            self.reuse.observe(flat_prompt(body), answer_suffix(body, completion.text))
        best = None
        if pod is not None and scores is not None and scores.best() > 0:
            best = scores.is_best(pod)
        record = RequestRecord(
            seq=seq,
            session=session,
            turn=turn,
            pod=pod,
            ok=completion.ok,
            error=completion.error,
            ttft=completion.ttft,
            e2e=completion.e2e,
            output_tokens=completion.output_tokens if completion.ok else 0,
            prompt_tokens=completion.prompt_tokens,
            cached_tokens=completion.cached_tokens,
            route_s=sent - routing,
            best_score=best,
            sent_at=sent - self.start,
            done_at=time.perf_counter() - self.start,
            matched_blocks=completion.matched_blocks,
        )
        return record, completion.text

    @property
    def score_error(self) -> str | None:
        """The last failed score call's reason (the kv router's, or an observation's)."""
        if isinstance(self.router, KVRouter):
            return self.router.last_error
        return self.observe_error


async def run_ladder(
    config: LoadgenConfig,
    *,
    routers: list[str] | None = None,
    qps: list[float | None],
    requests: int | None = None,
    duration: float | None = None,
    progress: ProgressFactory | None = None,
) -> list[StepResult]:
    """Every router at every QPS of the ladder, router-major; with ``config.target``, the
    target at every QPS (then no ``routers``). ``progress(name, qps, total)`` gives a context
    manager around each step that yields its per-request callback (see :func:`tqdm_progress`);
    ``total`` is the expected request count, None if unknown."""
    if config.target is not None and routers:
        raise ValueError("a target routes by itself: give no routers with it")
    if config.target is None and not routers:
        raise ValueError("no routers: give at least one, or a target")
    results = []
    for router in routers or [None]:
        name = router if router is not None else config.target_name
        for rate in qps:
            total = requests if requests is not None else _expected(config, rate, duration)
            bar = progress(name, rate, total) if progress is not None else nullcontext(None)
            with bar as tick:
                step = await run_step(
                    config, router=router, qps=rate, requests=requests, duration=duration, progress=tick
                )
            results.append(step)
    return results


def _expected(config: LoadgenConfig, qps: float | None, duration: float | None) -> int | None:
    if config.trace is not None:
        return len(load_window(config.trace)) if duration is None else None
    if duration is None:
        return config.workload.requests_per_pass
    return None if math.isinf(qps) else round(qps * duration)


@contextmanager
def tqdm_progress(
    router: str, qps: float | None, total: int | None, *, disable: bool = False
) -> Iterator[Progress]:
    """A tqdm bar for one step (on stderr); yields the per-request callback."""
    from tqdm import tqdm

    failed = 0
    rate = "own pace" if qps is None else "inf qps" if math.isinf(qps) else f"{qps:g} qps"
    with tqdm(total=total, desc=f"{router} @ {rate}", unit="req", disable=disable, leave=True) as bar:

        def tick(record: RequestRecord) -> None:
            nonlocal failed
            failed += not record.ok
            bar.update(1)
            if failed:
                bar.set_postfix(failed=failed, refresh=False)

        yield tick
