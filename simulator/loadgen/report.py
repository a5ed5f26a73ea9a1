"""What a run measured, summarised: percentiles, hit rates, the table, the JSON document.

Definitions (the summary's keys):

- ``ttft_s`` / ``e2e_s``: p50/p90/p99 over successful requests, seconds from sending the
  request to the pod (after routing) to its first text chunk / to ``[DONE]``. Percentiles
  interpolate linearly between order statistics (numpy's default method).
- ``itl_s``: p50/p90/p99 over successful requests of more than one output token of their mean
  inter-token latency, (``e2e`` - ``ttft``) / (output tokens - 1).
- ``output_tokens_per_s``: output tokens of successful requests over the run's span (first
  request sent to last one finished).
- ``fleet_hit_rate``: sum over pods of the growth of ``vllm:prefix_cache_hits_total`` divided
  by the growth of ``vllm:prefix_cache_queries_total`` between the scrapes before and after the
  run (tokens: all the traffic the pods served meanwhile, not only this run's, and hits on
  whatever they held before it). Pods that did not answer both scrapes are left out (``metrics_pods`` says how
  many counted); None when no pod counted or nothing was queried. ``fleet_prefix_hits`` /
  ``fleet_prefix_queries`` are None (unknown, not 0) when no pod counted, e.g. a ``--target``
  run given no pods.
- ``usage_hit_rate``: the same from the responses, cached_tokens / prompt_tokens.
- ``prefix_reuse_est`` (``reuse~`` in the table): the prefix reuse the workload itself offers,
  i.e. the hit rate of one prefix cache of unbounded size, empty at the start and fed only this
  run's requests, estimated on prompt text: each prompt's longest prefix (in whole 64-character
  chunks, the stand-in for KV blocks) shared with the prompt or prompt + answer of a request
  answered before it, over all prompt characters (successful requests only). It bounds
  ``fleet_hit_rate`` only when the pods' caches start empty (``--reset-prefix-cache``) and serve
  nothing else meanwhile: a fleet that still holds an earlier run's prefixes, or also serves
  other traffic (``make run``'s demo load), can exceed it, so it is no oracle (results written
  before call it ``oracle_hit_rate_est``). Characters stand in for tokens, so even then the two
  may differ by about a point.
- ``route_ms``: p50/p99 from taking a concurrency slot to sending to the pod: the score call
  (made for every router unless score observation is off) plus the choice.
- ``best_score_share``: among requests whose scores were known and where some pod scored above 0,
  the share sent to a pod with the highest score (``best_score_requests`` is that denominator).
  In a ``--target`` run the pod is the one the response named (``x-kvcache-pod``).
- ``target``: the URL every request went to (``--target``), None when loadgen routed. ``router``
  is then the run's label (``--label``, else ``target:<url>``).
- ``pod_source``: where a request's pod comes from: ``"router"`` (loadgen chose it) or
  ``"header"`` (the target named it in ``x-kvcache-pod``).
- ``pod_requests``: requests per pod, known pods only; ``pod_unknown_requests``: requests whose
  pod is unknown (a target that sent no ``x-kvcache-pod``); always 0 when loadgen routed.
- ``predicted_cached_tokens`` / ``reported_cached_tokens``: over the successful requests whose
  response had an ``x-kvcache-matched-blocks`` header and usage with ``cached_tokens``
  (``predicted_requests`` of them): the tokens the router's index predicted the pod holds
  (matched blocks x ``block_size``, less the last block when that covers the whole prompt: vLLM
  always computes one prompt token) and the tokens the pod reported cached; None when no request
  qualified. ``predicted_exact_share``: the share of those requests where the two are equal.
"""

from __future__ import annotations

import json
import math
import os
import platform
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from simulator.loadgen.client import PREFIX_HITS, PREFIX_QUERIES


@dataclass(frozen=True)
class RequestRecord:
    """One request of a run. Times in seconds; ``sent_at`` / ``done_at`` from the run's start.
    ``best_score`` is None when the scores were unknown or every pod scored 0. ``pod`` is None
    when unknown (a target that did not name it); ``matched_blocks`` is what the target's
    ``x-kvcache-matched-blocks`` header said, None without one."""

    seq: int
    session: str
    turn: int
    pod: str | None
    ok: bool
    error: str | None
    ttft: float | None
    e2e: float | None
    output_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    route_s: float
    best_score: bool | None
    sent_at: float
    done_at: float
    matched_blocks: int | None = None


@dataclass
class StepResult:
    """One run: one router (or one target) at one QPS, everything needed for its summary.
    ``block_size`` (tokens) turns a target's matched blocks into predicted cached tokens."""

    router: str
    qps: float
    records: list[RequestRecord]
    metrics_before: dict[str, dict[str, float] | None]
    metrics_after: dict[str, dict[str, float] | None]
    score_calls: int = 0
    score_failures: int = 0
    fallbacks: int = 0
    reuse_hit_chars: int = 0
    reuse_total_chars: int = 0
    notes: list[str] = field(default_factory=list)
    target: str | None = None
    block_size: int = 16


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError("q must be within 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(values: list[float], qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in qs}


def fleet_hit_rate(
    before: dict[str, dict[str, float] | None], after: dict[str, dict[str, float] | None]
) -> tuple[float | None, float, float, int]:
    """(hit rate, hits, queries, pods counted) from two scrapes of the pods' /metrics."""
    hits = queries = 0.0
    counted = 0
    for pod, start in before.items():
        end = after.get(pod)
        if start is None or end is None or PREFIX_QUERIES not in end:
            continue
        counted += 1
        hits += end.get(PREFIX_HITS, 0.0) - start.get(PREFIX_HITS, 0.0)
        queries += end[PREFIX_QUERIES] - start.get(PREFIX_QUERIES, 0.0)
    rate = hits / queries if queries > 0 else None
    return rate, hits, queries, counted


def predicted_cached_tokens(*, matched_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """The ``cached_tokens`` a vLLM pod reports for a prompt of which it holds ``matched_blocks``
    leading blocks: whole blocks only, and never the whole prompt (vLLM computes at least one
    prompt token, so a fully cached prompt loses its last block)."""
    tokens = matched_blocks * block_size
    if tokens >= prompt_tokens:
        tokens = max(0, (prompt_tokens - 1) // block_size * block_size)
    return tokens


class PrefixReuse:
    """How much of each prompt repeats a prefix of the requests answered before it: what one
    prefix cache of unbounded size, shared by every request and empty at the start, could serve
    (``prefix_reuse_est``).

    Texts are cut into ``chunk``-character pieces keyed by a chain hash (each key covers the
    whole prefix up to it, as KV block keys do), so a prompt's reusable prefix is its run of
    leading chunks whose keys were seen before; only whole chunks count, as only full blocks are
    cached. Shared prefixes are stored once: memory grows with distinct text, not requests.
    """

    def __init__(self, chunk: int = 64) -> None:
        if chunk < 1:
            raise ValueError("chunk must be at least 1 character")
        self.chunk = chunk
        self._seen: set[int] = set()
        self.hit_chars = 0
        self.total_chars = 0

    def _keys(self, text: str) -> list[int]:
        keys, key = [], 0
        for start in range(0, len(text) - self.chunk + 1, self.chunk):
            key = hash((key, text[start : start + self.chunk]))
            keys.append(key)
        return keys

    def observe(self, prompt: str, answer_suffix: str) -> int:
        """Count ``prompt`` and its reusable prefix (characters), then remember the chunks of
        ``prompt + answer_suffix`` (the answer is cached too, for the next turn)."""
        keys = self._keys(prompt + answer_suffix)
        reusable = 0
        for key in keys[: len(prompt) // self.chunk]:
            if key not in self._seen:
                break
            reusable += self.chunk
        self._seen.update(keys)
        self.hit_chars += reusable
        self.total_chars += len(prompt)
        return reusable

    @property
    def rate(self) -> float | None:
        return self.hit_chars / self.total_chars if self.total_chars else None


def summarize(step: StepResult) -> dict:
    """The summary of one run (keys documented in this module's docstring)."""
    records = step.records
    ok = [r for r in records if r.ok]
    hit_rate, hits, queries, counted = fleet_hit_rate(step.metrics_before, step.metrics_after)
    span = (max(r.done_at for r in records) - min(r.sent_at for r in records)) if records else 0.0
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok if r.prompt_tokens is not None)
    cached_tokens = sum(r.cached_tokens or 0 for r in ok if r.prompt_tokens is not None)
    judged = [r.best_score for r in records if r.best_score is not None]
    compared = [
        (
            predicted_cached_tokens(
                matched_blocks=r.matched_blocks, block_size=step.block_size, prompt_tokens=r.prompt_tokens
            ),
            r.cached_tokens,
        )
        for r in ok
        if r.matched_blocks is not None and r.prompt_tokens is not None and r.cached_tokens is not None
    ]
    return {
        "router": step.router,
        "qps": step.qps,
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": span,
        "ttft_s": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "e2e_s": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "itl_s": percentiles(
            [
                (r.e2e - r.ttft) / (r.output_tokens - 1)
                for r in ok
                if r.e2e is not None and r.ttft is not None and r.output_tokens > 1
            ]
        ),
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / span if span > 0 else None,
        "fleet_hit_rate": hit_rate,
        "fleet_prefix_hits": hits if counted else None,
        "fleet_prefix_queries": queries if counted else None,
        "metrics_pods": counted,
        "usage_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else None,
        "prefix_reuse_est": step.reuse_hit_chars / step.reuse_total_chars if step.reuse_total_chars else None,
        "best_score_share": sum(judged) / len(judged) if judged else None,
        "best_score_requests": len(judged),
        "score_calls": step.score_calls,
        "score_failures": step.score_failures,
        "score_fallbacks": step.fallbacks,
        "route_ms": percentiles([1000 * r.route_s for r in records], (50, 99)),
        "target": step.target,
        "pod_source": "header" if step.target is not None else "router",
        "pod_requests": dict(sorted(Counter(r.pod for r in records if r.pod is not None).items())),
        "pod_unknown_requests": sum(r.pod is None for r in records),
        "predicted_cached_tokens": sum(p for p, _ in compared) if compared else None,
        "reported_cached_tokens": sum(c for _, c in compared) if compared else None,
        "predicted_requests": len(compared),
        "predicted_exact_share": sum(p == c for p, c in compared) / len(compared) if compared else None,
        "errors": dict(Counter(r.error for r in records if r.error).most_common(5)),
        "notes": list(step.notes),
    }


COLUMNS = (
    ("router", "router"),
    ("qps", "qps"),
    ("ok", "ok"),
    ("failed", "fail"),
    ("ttft_s.p50", "TTFT p50"),
    ("ttft_s.p90", "p90"),
    ("ttft_s.p99", "p99"),
    ("e2e_s.p50", "E2E p50"),
    ("e2e_s.p90", "p90"),
    ("e2e_s.p99", "p99"),
    ("output_tokens_per_s", "out tok/s"),
    ("fleet_hit_rate", "hit rate"),
    ("prefix_reuse_est", "reuse~"),
    ("best_score_share", "best pick"),
    ("score_fallbacks", "fallbacks"),
)

# Printed under the table: what the columns that do not explain themselves measure.
LEGEND = (
    "hit rate   the pods' own prefix-cache hits / queries in the run, in tokens (all traffic they served)",
    "reuse~     the workload's prefix reuse: the hit rate one unbounded cache, empty at the start and fed",
    "           only this run, would reach (estimated on text); a fleet beats it when its caches held",
    "           prefixes before the run (no --reset-prefix-cache) or it served other traffic meanwhile",
    "best pick  requests sent to a pod with the highest score, of those where some pod scored above 0",
    "fallbacks  kv requests routed least-loaded because the score call failed",
)


def _cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key.endswith("_rate") or key.endswith("_est") or key.endswith("_share"):
        return f"{100 * value:.1f}%"
    if key.startswith(("ttft_s", "e2e_s")):
        return f"{value:.3f}"
    if key == "qps":
        return "inf" if math.isinf(value) else f"{value:.3g}"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


def _lookup(summary: dict, dotted: str):
    value = summary
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def render_table(summaries: list[dict]) -> str:
    """A fixed-width text table, one row per run; latencies in seconds."""
    header = [title for _, title in COLUMNS]
    rows = [[_cell(key, _lookup(s, key)) for key, _ in COLUMNS] for s in summaries]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(COLUMNS))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def pod_lines(summary: dict) -> list[str]:
    """What a target run says about its pods, for people: the requests per pod (``"pods: sim-0
    12, sim-1 8, unknown 3"``) and, when the target predicted cached tokens, those against what
    the pods reported. Nothing for a run loadgen routed (its pods are its own choice)."""
    if summary.get("pod_source") != "header":
        return []
    counts = [f"{pod} {n}" for pod, n in summary["pod_requests"].items()]
    if summary["pod_unknown_requests"]:
        counts.append(f"unknown {summary['pod_unknown_requests']}")
    lines = [f"pods: {', '.join(counts) or 'no requests'}"]
    if summary["predicted_requests"]:
        lines.append(
            f"cached tokens: {summary['predicted_cached_tokens']:,} predicted, "
            f"{summary['reported_cached_tokens']:,} reported "
            f"({100 * summary['predicted_exact_share']:.1f}% of {summary['predicted_requests']} "
            "requests exact)"
        )
    return lines


def machine() -> dict:
    """Where the run happened (for the JSON document)."""
    return {
        "host": platform.node(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(),
    }


def results_document(summaries: list[dict], params: dict) -> dict:
    """The machine-readable results: parameters, machine, one summary per run."""
    return {"params": params, "machine": machine(), "runs": summaries}


def write_json(path: str | Path, document: dict) -> Path:
    """Write ``document`` as strict JSON (an infinite QPS is written as the string "inf")."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(document), indent=2, allow_nan=False) + "\n")
    return path


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value
