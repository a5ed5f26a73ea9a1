"""Pod liveness: which pods answer ``GET /health``, what follows when one stops, and the one-word
state of a pod shown to people.

``LivenessProber`` (run by ``manage.py ingest``) probes every target (pod -> ``host:port``:
enabled pods that have an address, ``probe_targets``) at ``http://<address>/health`` every
``interval`` seconds, on one asyncio loop in one thread of its own, with at most ``concurrency``
probes in flight, each over a new connection (a kept-alive one would hide a listener that no
longer accepts) and bounded by ``timeout`` as a whole (connect, send, headers). A probe fails on a
refused or reset connection, a timeout, or a status other than 2xx. The callbacks run between
the rounds' probes, never inside the event loop. Per pod:

* **down**: its probes have failed without a break for ``down_seconds`` (from the start of the
  first failed probe). A down pod leaves scores like a disabled one (``ServiceConfig.down_pods``)
  but keeps its blocks in the index, so that it scores again the moment it answers;
* **up**: one probe succeeded (also the first verdict on a pod that answers); a pod up again
  after being down goes to ``on_return`` too (its engine may have restarted meanwhile: ingest
  checks before the pod's old blocks are scored, ``ingest.resync``);
* **forgotten**: down for ``forget_seconds`` more (0: never): its blocks and those of its
  data-parallel ranks are cleared from the index, once per down spell. An engine gone that long has
  most likely restarted with an empty cache; a vLLM restart publishes no ``AllBlocksCleared``;
* **unknown** again: a pod that is no longer probed (disabled, deleted, address removed).

Up pods that ingest finds quiet are asked for their ``/metrics`` too (``busy`` when they serve),
each read bounded in time (``timeout``) and size (``registry.pod_metrics``): a pod whose answer is
malformed, huge, slow or missing keeps its last verdict, and that failure is counted by reason
and logged when a pod's reason changes. No pod's answer, nor any of the probes', can end a round
early or hold back another pod's verdict.

Changes of health go out through ``on_change`` (the Django shell writes them to the registry); when
it raises, or a round fails part way, the changes made are offered again after the next round.
``stats`` counts probes, failures by reason, ``/metrics`` reads and their failures by reason, and
pods forgotten (``LivenessCollector`` exports them). No Django import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvindex import IndexUnavailable, KVIndex
from registry.config import ServiceConfig
from registry.pod_metrics import READ_FAILURES, PodMetricsError, RequestsReader

log = logging.getLogger(__name__)

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
HEALTHS = ("unknown", "up", "busy", "down")
"""What the registry's ``Pod.health`` may say: ``busy`` is up, with requests running or waiting
(its ``/metrics``) while ingest has had no KV event from it for a while (``quiet``): it serves but
its events do not arrive, so what the index holds of it goes stale."""

FAILURE_REASONS = ("connect", "timeout", "status", "error")
"""Why a probe failed: the connection was refused or reset; no answer within the timeout; an answer
other than 2xx; anything else (an address that is not ``host:port``, a broken response)."""

POD_STATES = ("active", "idle", "stale", "down", "disabled")
"""The one-word states of ``pod_state``, in the order the dashboard ranks them."""


@dataclass(frozen=True, slots=True)
class LivenessSettings:
    """Seconds, except ``concurrency`` (probes in flight at most). A round of N pods takes at most
    ``ceil(N / concurrency) * timeout`` seconds for their ``/health``, however many pods hang, and
    as long again when quiet pods' ``/metrics`` are read."""

    interval: float = 1.0
    timeout: float = 1.0
    down_seconds: float = 10.0
    forget_seconds: float = 300.0
    concurrency: int = 128

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.timeout <= 0 or self.down_seconds < 0 or self.forget_seconds < 0:
            raise ValueError("interval and timeout must be > 0, down_seconds and forget_seconds >= 0")
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")


@dataclass(frozen=True, slots=True)
class HealthChange:
    """``pod``'s health became ``health`` (one of ``HEALTHS``) at ``at`` (unix time), from
    ``previous``."""

    pod: str
    health: str
    at: float
    previous: str = "unknown"


@dataclass(slots=True)
class LivenessStats:
    """Counters since the prober started. Written by the prober's thread only."""

    probes: int = 0
    failures: Counter = field(default_factory=Counter)  # reason -> probes
    metrics_reads: int = 0  # /metrics of quiet pods asked for
    metrics_failures: Counter = field(default_factory=Counter)  # reason (READ_FAILURES) -> reads
    forgotten: int = 0  # pods whose blocks were cleared after forget_seconds down
    rounds: int = 0
    last_round_seconds: float = 0.0


@dataclass(slots=True)
class _Tracked:
    """What the prober knows of one target."""

    address: str
    health: str = "unknown"  # the last verdict reported
    failing_since: float | None = None  # monotonic start of the first failed probe of this run
    down_since: float | None = None  # monotonic time it was found down
    forgotten: bool = False
    metrics_problem: str | None = None  # why its last /metrics read failed (logged on a change)


def probe_targets(config: ServiceConfig) -> dict[str, str]:
    """The pods to probe, pod -> address: every pod with an address that is not disabled."""
    return {pod: address for pod, address in config.pod_addresses.items() if pod not in config.disabled_pods}


def clear_pod_and_ranks(index: KVIndex, pod: str) -> int:
    """Remove every block of ``pod``, of its data-parallel ranks (``pod#dp<r>``) and of their
    KV-cache groups (``...#g<g>``) under every model; returns how many entries went."""
    removed = index.clear_pod(pod=pod)
    prefix = pod + "#"  # a pod id has no "#"
    for holder in {row.pod for row in index.pod_blocks() if row.pod.startswith(prefix)}:
        removed += index.clear_pod(pod=holder)
    return removed


class LivenessProber:
    """Probes ``targets()`` (called once per round) and reports changes of health to
    ``on_change``; clears a pod's blocks from ``index`` once it has been down ``forget_seconds``
    (not when ``index`` is ``None``). ``start``/``stop`` run it in a thread; ``probe_once`` runs
    one round in the calling thread."""

    def __init__(
        self,
        *,
        targets: Callable[[], Mapping[str, str]],
        index: KVIndex | None = None,
        on_change: Callable[[list[HealthChange]], object] | None = None,
        settings: LivenessSettings | None = None,
        quiet: Callable[[], Collection[str]] | None = None,
        on_return: Callable[[str], object] | None = None,
    ) -> None:
        self.targets = targets
        self.on_return = on_return  # a pod answers again after being down (it may have restarted)
        self.quiet = quiet  # pods ingest has had no event from for a while: up, or busy?
        self.index = index
        self.on_change = on_change
        self.settings = settings or LivenessSettings()
        self.stats = LivenessStats()
        self._lock = threading.Lock()  # guards _tracked (read by other threads: metrics)
        self._tracked: dict[str, _Tracked] = {}
        self._unreported: dict[str, HealthChange] = {}  # pod -> latest change on_change has not taken
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the thread's
        self._probing: asyncio.Task | None = None  # the probes of the round in flight

    # --- reading ---------------------------------------------------------------------------

    def health(self) -> dict[str, str]:
        """pod -> health, of the pods being probed."""
        with self._lock:
            return {pod: t.health for pod, t in self._tracked.items()}

    def health_counts(self) -> dict[str, int]:
        """How many probed pods have each health (every one of ``HEALTHS``, zeros included)."""
        counts = Counter(self.health().values())
        return {health: counts.get(health, 0) for health in HEALTHS}

    # --- running -----------------------------------------------------------------------------

    def start(self) -> None:
        """Probe in a thread of its own until ``stop``."""
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run_thread, name="liveness-prober", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop probing (a round in flight is abandoned) and wait for the thread."""
        self._stopping.set()
        loop, probing = self._loop, self._probing
        if loop is not None and probing is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(probing.cancel)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def probe_once(self) -> list[HealthChange]:
        """One round now, in the calling thread (which must not run an event loop); returns the
        changes it found."""
        loop = asyncio.new_event_loop()
        client = self._client()
        try:
            return self._round(loop, client)
        finally:
            loop.run_until_complete(client.aclose())
            loop.close()

    def _run_thread(self) -> None:
        self._loop = loop = asyncio.new_event_loop()
        client = self._client()
        try:
            while not self._stopping.is_set():
                started = time.monotonic()
                try:
                    self._round(loop, client)
                except asyncio.CancelledError:  # stop() abandoned the round
                    break
                except Exception:  # e.g. the registry unreadable: this round is lost, not the prober
                    log.exception("liveness probe round failed")
                self._stopping.wait(self.settings.interval - (time.monotonic() - started))
        finally:
            loop.run_until_complete(client.aclose())
            loop.close()

    def _client(self) -> httpx.AsyncClient:
        s = self.settings
        return httpx.AsyncClient(
            timeout=s.timeout,
            limits=httpx.Limits(max_connections=s.concurrency, max_keepalive_connections=0),
            trust_env=False,  # pods are probed directly, never through the environment's proxy
            follow_redirects=False,
        )

    # --- one round ---------------------------------------------------------------------------

    def _round(self, loop: asyncio.AbstractEventLoop, client: httpx.AsyncClient) -> list[HealthChange]:
        """Probe every target on ``loop``. The callbacks (``targets``, ``on_change``) run while the
        loop does not: they may block, and Django refuses database calls inside a running loop."""
        started = time.monotonic()
        targets = dict(self.targets())
        changes = self._retarget(targets)
        try:
            self._probing = loop.create_task(self._probe_all(client, list(targets.values())))
            results = loop.run_until_complete(self._probing)
            with self._lock:
                for pod, (probe_started, reason) in zip(targets, results, strict=True):
                    change = self._observe(self._tracked[pod], pod, probe_started, reason)
                    if change is not None:
                        changes.append(change)
            changes += self._judge_busy(loop, client, targets)
            self._forget_due()
        finally:
            # The verdicts made are the tracker's now: a round that fails after them (the quiet
            # pods unreadable) must still report them, or the registry would never hear of them.
            self.stats.rounds += 1
            self.stats.last_round_seconds = time.monotonic() - started
            self._report(changes)
        return changes

    async def _probe_all(
        self, client: httpx.AsyncClient, addresses: list[str]
    ) -> list[tuple[float, str | None]]:
        gate = asyncio.Semaphore(self.settings.concurrency)
        return await asyncio.gather(*(self._probe(client, gate, address) for address in addresses))

    async def _probe(
        self, client: httpx.AsyncClient, gate: asyncio.Semaphore, address: str
    ) -> tuple[float, str | None]:
        """(monotonic start, failure reason or ``None`` for a 2xx answer) of one probe."""
        async with gate:
            started = time.monotonic()
            self.stats.probes += 1
            try:
                async with asyncio.timeout(self.settings.timeout):
                    # Only the status is wanted: the body is never read (nor buffered).
                    async with client.stream("GET", f"http://{address}{HEALTH_PATH}") as response:
                        reason = None if response.is_success else "status"
            except (TimeoutError, httpx.TimeoutException):
                reason = "timeout"
            except httpx.ConnectError:
                reason = "connect"
            except Exception:  # a broken answer, an address that is not host:port: this pod's alone
                reason = "error"
            if reason is not None:
                self.stats.failures[reason] += 1
            return started, reason

    def _judge_busy(
        self, loop: asyncio.AbstractEventLoop, client: httpx.AsyncClient, targets: Mapping[str, str]
    ) -> list[HealthChange]:
        """Up pods become busy when they are quiet (no event for a while) and their ``/metrics``
        show requests; busy ones become up again when events arrive or the requests are done."""
        quiet = set(self.quiet()) if self.quiet is not None else set()
        with self._lock:
            alive = {
                pod: self._tracked[pod].health
                for pod in targets
                if self._tracked[pod].health in ("up", "busy")
            }
        asked = [pod for pod in alive if pod in quiet]
        counts = (
            loop.run_until_complete(self._requests_all(client, [targets[p] for p in asked])) if asked else []
        )
        busy = {pod for pod, n in zip(asked, counts, strict=True) if isinstance(n, float) and n}
        unknown = {pod for pod, n in zip(asked, counts, strict=True) if isinstance(n, PodMetricsError)}
        changes = []
        now = time.time()
        with self._lock:
            for pod, outcome in zip(asked, counts, strict=True):
                self._note_metrics(pod, outcome)
            for pod, health in alive.items():
                if pod in unknown:
                    continue  # no answer: keep the last verdict
                wanted = "busy" if pod in busy else "up"
                tracked = self._tracked.get(pod)
                if tracked is not None and tracked.health == health != wanted:
                    tracked.health = wanted
                    changes.append(HealthChange(pod, wanted, now, health))
        return changes

    async def _requests_all(
        self, client: httpx.AsyncClient, addresses: list[str]
    ) -> list[float | PodMetricsError]:
        gate = asyncio.Semaphore(self.settings.concurrency)
        return await asyncio.gather(*(self._requests(client, gate, address) for address in addresses))

    async def _requests(
        self, client: httpx.AsyncClient, gate: asyncio.Semaphore, address: str
    ) -> float | PodMetricsError:
        """Running + waiting requests the pod reports, or why it did not say (never raises but
        when cancelled): the body is read as it comes, up to ``MAX_METRICS_BYTES``, the whole
        answer within ``timeout``."""
        async with gate:
            self.stats.metrics_reads += 1
            try:
                async with asyncio.timeout(self.settings.timeout):
                    return await self._read_requests(client, address)
            except PodMetricsError as error:
                return error
            except (TimeoutError, httpx.TimeoutException):
                return PodMetricsError("timeout", f"no whole answer within {self.settings.timeout:g}s")
            except httpx.ConnectError as error:
                return PodMetricsError("connect", str(error) or type(error).__name__)
            except Exception as error:  # whatever the pod sent or the address says: its failure alone
                return PodMetricsError("error", f"{type(error).__name__}: {error}")

    @staticmethod
    async def _read_requests(client: httpx.AsyncClient, address: str) -> float:
        # Raw bytes, identity asked for: a compressed body would be inflated before any bound.
        headers = {"accept-encoding": "identity"}
        async with client.stream("GET", f"http://{address}{METRICS_PATH}", headers=headers) as response:
            if not response.is_success:
                raise PodMetricsError("status", f"HTTP {response.status_code}")
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding != "identity":
                raise PodMetricsError("malformed", f"a {encoding!r} body where identity was asked for")
            reader = RequestsReader()
            async with contextlib.aclosing(response.aiter_raw()) as chunks:  # closed when feed raises
                async for chunk in chunks:
                    reader.feed(chunk)
            return sum(reader.counts())

    def _note_metrics(self, pod: str, outcome: float | PodMetricsError) -> None:
        """Count a failed ``/metrics`` read and log a pod's reason when it changes (requires the
        lock): one line when a pod goes wrong, one when it reads again, not one a round."""
        tracked = self._tracked.get(pod)
        reason = outcome.reason if isinstance(outcome, PodMetricsError) else None
        if reason is not None:
            self.stats.metrics_failures[reason] += 1
        if tracked is None or tracked.metrics_problem == reason:
            return
        if reason is not None:
            log.warning("pod %s: no request counts from its /metrics (%s: %s)", pod, reason, outcome)
        else:
            log.info("pod %s: its /metrics gives request counts again", pod)
        tracked.metrics_problem = reason

    def _retarget(self, targets: Mapping[str, str]) -> list[HealthChange]:
        """Track the pods of ``targets``; pods no longer among them go back to unknown."""
        changes = []
        now = time.time()
        with self._lock:
            for pod in [p for p in self._tracked if p not in targets]:
                if self._tracked.pop(pod).health != "unknown":
                    changes.append(HealthChange(pod, "unknown", now))
            for pod, address in targets.items():
                tracked = self._tracked.get(pod)
                if tracked is None:
                    self._tracked[pod] = _Tracked(address=address)
                elif tracked.address != address:  # a new address is judged afresh
                    tracked.address, tracked.failing_since = address, None
        return changes

    def _observe(
        self, tracked: _Tracked, pod: str, started: float, reason: str | None
    ) -> HealthChange | None:
        """Apply one probe's outcome (requires the lock); the change of health it makes, if any."""
        if reason is None:
            tracked.failing_since = tracked.down_since = None
            tracked.forgotten = False
            if tracked.health not in ("up", "busy"):  # busy or not: _judge_busy says
                previous, tracked.health = tracked.health, "up"
                return HealthChange(pod, "up", time.time(), previous)
            return None
        if tracked.failing_since is None:
            tracked.failing_since = started
        now = time.monotonic()
        if tracked.health != "down" and now - tracked.failing_since >= self.settings.down_seconds:
            previous, tracked.health, tracked.down_since = tracked.health, "down", now
            return HealthChange(pod, "down", time.time(), previous)
        return None

    def _forget_due(self) -> None:
        """Clear the blocks of every pod down for ``forget_seconds`` and not yet forgotten."""
        if not self.settings.forget_seconds:
            return
        now, forget = time.monotonic(), self.settings.forget_seconds
        with self._lock:
            due = [
                (pod, t)
                for pod, t in self._tracked.items()
                if t.down_since is not None and not t.forgotten and now - t.down_since >= forget
            ]
        for pod, tracked in due:
            if self.index is not None:
                try:
                    removed = clear_pod_and_ranks(self.index, pod)
                except IndexUnavailable as e:
                    log.warning("could not clear the blocks of down pod %s (next round retries): %s", pod, e)
                    continue
                log.info("pod %s down for %ss: cleared its blocks (%d entries)", pod, forget, removed)
            tracked.forgotten = True
            self.stats.forgotten += 1

    def _report(self, changes: list[HealthChange]) -> None:
        for change in changes:
            if change.previous == "down" and change.health in ("up", "busy") and self.on_return is not None:
                try:
                    self.on_return(change.pod)
                except Exception:
                    log.exception("could not act on pod %s answering again", change.pod)
            self._unreported[change.pod] = change
        if not self._unreported or self.on_change is None:
            self._unreported.clear()
            return
        try:
            self.on_change(list(self._unreported.values()))
        except Exception:
            log.exception(
                "could not report %d changes of pod health (next round retries)", len(self._unreported)
            )
        else:
            self._unreported.clear()


class LivenessCollector(Collector):
    """A ``LivenessProber``'s counters and its pods by health, for prometheus_client."""

    def __init__(self, prober: LivenessProber) -> None:
        self.prober = prober

    def collect(self) -> Iterator:
        stats = self.prober.stats
        probes = CounterMetricFamily("kvcache_liveness_probes", "Health probes of pods sent.")
        probes.add_metric([], stats.probes)
        yield probes
        failures = CounterMetricFamily(
            "kvcache_liveness_probe_failures", "Health probes that failed, by reason.", labels=["reason"]
        )
        for reason in FAILURE_REASONS:
            failures.add_metric([reason], stats.failures.get(reason, 0))
        yield failures
        reads = CounterMetricFamily(
            "kvcache_liveness_metrics_reads", "Reads of quiet pods' /metrics (are they serving?)."
        )
        reads.add_metric([], stats.metrics_reads)
        yield reads
        read_failures = CounterMetricFamily(
            "kvcache_liveness_metrics_failures",
            "Reads of pods' /metrics that gave no request counts, by reason (the pod keeps its health).",
            labels=["reason"],
        )
        for reason in READ_FAILURES:
            read_failures.add_metric([reason], stats.metrics_failures.get(reason, 0))
        yield read_failures
        forgotten = CounterMetricFamily(
            "kvcache_liveness_pods_forgotten",
            "Times a pod down for KVCACHE_POD_FORGET_SECONDS had its blocks cleared from the index.",
        )
        forgotten.add_metric([], stats.forgotten)
        yield forgotten
        pods = GaugeMetricFamily("kvcache_liveness_pods", "Probed pods by health.", labels=["health"])
        for health, n in self.prober.health_counts().items():
            pods.add_metric([health], n)
        yield pods

    def describe(self) -> list:
        return []


def pod_state(*, enabled: bool, health: str, last_event_age: float | None, stale_after: float) -> str:
    """A pod's state in one word (``POD_STATES``), for the dashboard, the registry API and metrics.
    The first rule that applies:

    * ``disabled``: the registry says so; its blocks are out of the index and of scores;
    * ``down``: the liveness prober finds its ``/health`` failing; out of scores, blocks kept;
    * ``active``: an event arrived within ``stale_after`` seconds (``last_event_age``);
    * ``idle``: no event for that long, but the prober finds it up and not serving: an engine
      without traffic publishes nothing, and the blocks it holds stay valid; scored as usual;
    * ``stale``: no event for that long (or never) though it is healthy and serving (``busy``: its
      events do not arrive, so what the index holds of it goes stale), or nothing says the engine
      is alive (no address to probe, not probed yet): its blocks may belong to an engine that is
      gone. Still scored; fix its event publishing, or give it an address (or disable it).
    """
    if not enabled:
        return "disabled"
    if health == "down":
        return "down"
    if last_event_age is not None and last_event_age <= stale_after:
        return "active"
    return "idle" if health == "up" else "stale"
