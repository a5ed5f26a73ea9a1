"""Runs the workload against a fleet: Poisson arrivals, routing, streaming, measuring.

One *step* is one router at one QPS. Every step replays the same workload and, at a given QPS,
the same arrival times (both seeded), so routers are compared on identical traffic. By default
each step starts from empty prefix caches (``POST /reset_prefix_cache`` on every pod, then
``settle`` seconds for the pods' AllBlocksCleared events to reach the index).

Per request: wait for the session's previous turn (multi-turn), take a concurrency slot, ask
the scoring service for scores (kv routers need them; for the others they are fetched too,
before sending, to measure how often the chosen pod was the best one), choose the pod, stream
the completion. TTFT and end-to-end latency are measured from sending to the pod, so routing
time (``route_ms`` in the report) is counted separately.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx

from simulator.loadgen.client import fetch_scores, reset_prefix_cache, scrape_fleet, stream_completion
from simulator.loadgen.report import OracleEstimate, RequestRecord, StepResult
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
from simulator.loadgen.workload import (
    Conversation,
    Turn,
    WorkloadSpec,
    answer_suffix,
    completion_body,
    flat_prompt,
    score_query,
    system_prompt,
    turn_stream,
)

DEFAULT_SCORE_URL = "http://127.0.0.1:8000/api/v1/score"
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"

Progress = Callable[[RequestRecord], None]
ProgressFactory = Callable[[str, float, int | None], AbstractContextManager[Progress | None]]


@dataclass(frozen=True)
class LoadgenConfig:
    """Everything a run needs besides the router, the QPS and its length.

    ``pods`` maps pod id -> base URL (``http://host:port``, no path). ``concurrency`` caps
    requests in flight from loadgen; arrivals beyond it wait (that wait is not in TTFT).
    """

    pods: dict[str, str]
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
    reset_prefix_cache: bool = True
    settle: float = 1.0
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)

    def __post_init__(self) -> None:
        if not self.pods:
            raise ValueError("no pods: give a base URL and a pod count, or pods one by one")
        if self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("concurrency and max_tokens must be at least 1")

    def describe(self) -> dict:
        """The configuration for a results file (the API key left out)."""
        described = {k: v for k, v in asdict(self).items() if k != "api_key"}
        described["api_key"] = "set" if self.api_key else None
        return described

    def endpoint(self, pod: str) -> str:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        return f"{self.pods[pod]}{path}"


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
    router: str,
    qps: float,
    requests: int | None = None,
    duration: float | None = None,
    progress: Progress | None = None,
) -> StepResult:
    """One router at one QPS. Stops issuing after ``requests`` requests or ``duration``
    seconds (whichever first; one pass of the workload when neither is given), then waits for
    the requests in flight."""
    if requests is None and duration is None:
        requests = config.workload.requests_per_pass
    if requests is None and math.isinf(qps):
        raise ValueError("an infinite QPS needs a request count, not a duration")
    limits = httpx.Limits(max_connections=config.concurrency + 2 * len(config.pods) + 8)
    timeout = httpx.Timeout(config.timeout, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        notes: list[str] = []
        if config.reset_prefix_cache:
            refused = await reset_prefix_cache(client, config.pods)
            if refused:
                notes.append(f"prefix cache not reset on {', '.join(refused)}")
            await asyncio.sleep(config.settle)
        before = await scrape_fleet(client, config.pods)
        run = _Run(config, client, router)
        await run.drive(qps=qps, requests=requests, duration=duration, progress=progress)
        after = await scrape_fleet(client, config.pods)
    silent = [pod for pod in config.pods if before[pod] is None or after[pod] is None]
    if silent:
        notes.append(f"no /metrics from {', '.join(silent)}")
    if isinstance(run.router, KVRouter) and run.router.last_error:
        notes.append(f"last score error: {run.router.last_error}")
    return StepResult(
        router=router,
        qps=qps,
        records=sorted(run.records, key=lambda r: r.seq),
        metrics_before=before,
        metrics_after=after,
        score_calls=run.lookup.calls,
        score_failures=run.lookup.failures,
        fallbacks=run.router.fallbacks if isinstance(run.router, KVRouter) else 0,
        oracle_hit_chars=run.oracle.hit_chars,
        oracle_total_chars=run.oracle.total_chars,
        notes=notes,
    )


class _Run:
    """The state of one step while it runs."""

    def __init__(self, config: LoadgenConfig, client: httpx.AsyncClient, router: str) -> None:
        self.config = config
        self.client = client
        self.pods = list(config.pods)
        self.in_flight = InFlight(self.pods)
        self.lookup = ScoreLookup(self._fetch_scores)
        self.router = make_router(
            router,
            pods=self.pods,
            lookup=self.lookup,
            in_flight=self.in_flight,
            rng=random.Random(f"{config.seed}/router/{router}"),
            alpha=config.alpha,
        )
        self.slots = asyncio.Semaphore(config.concurrency)
        self.sessions: dict[str, _Session] = {}
        self.oracle = OracleEstimate()
        self.records: list[RequestRecord] = []
        self.start = 0.0
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
        self, *, qps: float, requests: int | None, duration: float | None, progress: Progress | None
    ) -> None:
        self.start = time.perf_counter()
        turns = turn_stream(self.config.workload)
        tasks = []
        for issued, at in enumerate(arrival_times(self.config.seed, qps)):
            if (requests is not None and issued >= requests) or (duration is not None and at >= duration):
                break
            delay = self.start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            turn = next(turns)
            session = self.sessions.get(turn.session)
            if session is None:
                if turn.group not in self._system_prompts:
                    self._system_prompts[turn.group] = system_prompt(self.config.workload, turn.group)
                session = self.sessions[turn.session] = _Session(
                    Conversation(self._system_prompts[turn.group])
                )
            wait_for, done = session.previous_done, asyncio.Event()
            session.previous_done = done
            tasks.append(asyncio.create_task(self._one(turn, session, wait_for, done, progress)))
        await asyncio.gather(*tasks)

    async def _one(
        self,
        turn: Turn,
        session: _Session,
        wait_for: asyncio.Event | None,
        done: asyncio.Event,
        progress: Progress | None,
    ) -> None:
        try:
            if wait_for is not None:
                await wait_for.wait()
            async with self.slots:
                record = await self._send(turn, session)
            self.records.append(record)
            if progress is not None:
                progress(record)
        finally:
            done.set()
            if turn.last:
                self.sessions.pop(turn.session, None)

    async def _send(self, turn: Turn, session: _Session) -> RequestRecord:
        config = self.config
        body = completion_body(
            model=config.model,
            max_tokens=config.max_tokens,
            chat=config.chat,
            conversation=session.conversation,
            user=turn.user,
        )
        request = RouteRequest(id=turn.seq, score_query=score_query(body, self.pods))
        routing = time.perf_counter()
        if config.observe_scores and not isinstance(self.router, KVRouter):
            with suppress(ScoreUnavailable):  # counted by the lookup; these routers need no scores
                await self.lookup.scores(request)
        pod = await self.router.choose(request)
        scores = self.lookup.known(request)
        self.lookup.forget(request)
        sent = time.perf_counter()
        self.in_flight.start(pod)
        try:
            completion = await stream_completion(self.client, config.endpoint(pod), body)
        finally:
            self.in_flight.finish(pod)
        if completion.ok:
            session.conversation.record(turn.user, completion.text)
            self.oracle.observe(flat_prompt(body), answer_suffix(body, completion.text))
        return RequestRecord(
            seq=turn.seq,
            session=turn.session,
            turn=turn.turn,
            pod=pod,
            ok=completion.ok,
            error=completion.error,
            ttft=completion.ttft,
            e2e=completion.e2e,
            output_tokens=completion.output_tokens if completion.ok else 0,
            prompt_tokens=completion.prompt_tokens,
            cached_tokens=completion.cached_tokens,
            route_s=sent - routing,
            best_score=scores.is_best(pod) if scores is not None and scores.best() > 0 else None,
            sent_at=sent - self.start,
            done_at=time.perf_counter() - self.start,
        )


async def run_ladder(
    config: LoadgenConfig,
    *,
    routers: list[str],
    qps: list[float],
    requests: int | None = None,
    duration: float | None = None,
    progress: ProgressFactory | None = None,
) -> list[StepResult]:
    """Every router at every QPS of the ladder, router-major. ``progress(router, qps, total)``
    gives a context manager around each step that yields its per-request callback (see
    :func:`tqdm_progress`); ``total`` is the expected request count, None if unknown."""
    results = []
    for router in routers:
        for rate in qps:
            total = requests if requests is not None else _expected(config, rate, duration)
            bar = progress(router, rate, total) if progress is not None else nullcontext(None)
            with bar as tick:
                step = await run_step(
                    config, router=router, qps=rate, requests=requests, duration=duration, progress=tick
                )
            results.append(step)
    return results


def _expected(config: LoadgenConfig, qps: float, duration: float | None) -> int | None:
    if duration is None:
        return config.workload.requests_per_pass
    return None if math.isinf(qps) else round(qps * duration)


@contextmanager
def tqdm_progress(router: str, qps: float, total: int | None, *, disable: bool = False) -> Iterator[Progress]:
    """A tqdm bar for one step (on stderr); yields the per-request callback."""
    from tqdm import tqdm

    failed = 0
    rate = "inf" if math.isinf(qps) else f"{qps:g}"
    with tqdm(total=total, desc=f"{router} @ {rate} qps", unit="req", disable=disable, leave=True) as bar:

        def tick(record: RequestRecord) -> None:
            nonlocal failed
            failed += not record.ok
            bar.update(1)
            if failed:
                bar.set_postfix(failed=failed, refresh=False)

        yield tick
