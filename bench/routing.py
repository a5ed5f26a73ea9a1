"""Routing benchmark: every router over a QPS ladder, against a stack that is already running.

Start the stack first (web + ingest: ``make run``; a simulated fleet publishing to ingest), then:

    .venv/bin/python bench/routing.py --pods-url http://127.0.0.1:8100 --pods 4 \\
        [--routers kv,kv-load,least-loaded,round-robin,random] [--qps 2,4,8,16] \\
        [--duration 30 | --requests N] [--score-url http://127.0.0.1:8000/api/v1/score] \\
        [--out var/bench/routing.json] [--plot docs/routing.png]

It runs the load generator in process (``simulator.loadgen``; the same core as
``manage.py loadgen``), one run per router and QPS, each from empty prefix caches, prints the
table, writes the JSON results and a plot of TTFT p90 against QPS per router (log scale).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.loadgen.report import render_table, results_document, summarize, write_json  # noqa: E402
from simulator.loadgen.routers import DEFAULT_ALPHA, ROUTER_NAMES  # noqa: E402
from simulator.loadgen.runner import (  # noqa: E402
    DEFAULT_MODEL,
    DEFAULT_SCORE_URL,
    LoadgenConfig,
    fleet_from_base,
    parse_pod,
    parse_qps,
    run_ladder,
    tqdm_progress,
)
from simulator.loadgen.workload import WorkloadSpec  # noqa: E402

DEFAULT_ROUTERS = "kv,kv-load,least-loaded,round-robin,random"
# Long enough for the cold start (every group's first, uncached prefills) to be a small share.
DEFAULT_DURATION = 30.0


def plot(summaries: list[dict], path: str | Path, *, title: str = "") -> Path:
    """TTFT p90 against QPS, one line per router, log-scale y; runs at an infinite QPS or
    without a TTFT are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for router in dict.fromkeys(s["router"] for s in summaries):
        points = sorted(
            (s["qps"], s["ttft_s"]["p90"])
            for s in summaries
            if s["router"] == router and math.isfinite(s["qps"]) and s["ttft_s"]["p90"]
        )
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=router)
    ax.set_yscale("log")
    ladder = sorted({s["qps"] for s in summaries if math.isfinite(s["qps"])})
    if ladder and ladder[0] > 0 and len(ladder) > 1 and ladder[-1] / ladder[0] >= 4:
        ax.set_xscale("log", base=2)  # ladders are usually geometric: 2, 4, 8, 16
    ax.set_xticks(ladder)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    seconds = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(seconds)
    low, high = ax.get_ylim()
    # Label the 2..9 ticks too when the plot spans little more than a decade, else they crowd.
    ax.yaxis.set_minor_formatter(seconds if high / low < 30 else NullFormatter())
    ax.set_xlabel("offered load (requests/s, Poisson)")
    ax.set_ylabel("TTFT p90 (s, log scale)")
    ax.set_title(title or "TTFT p90 by router")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pods-url", help="Base URL of pod sim-0; pod sim-i is on its port + i.")
    parser.add_argument("--pods", type=int, default=4, help="Pod count with --pods-url (default 4).")
    parser.add_argument("--pod", action="append", default=[], metavar="POD=URL", help="Explicit pods.")
    parser.add_argument("--score-url", default=DEFAULT_SCORE_URL)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--completions", action="store_true", help="Use /v1/completions (default: chat).")
    parser.add_argument("--routers", default=DEFAULT_ROUTERS, help=f"Comma-separated, of {ROUTER_NAMES}.")
    parser.add_argument("--qps", default="2,4,8,16", help="The QPS ladder (default 2,4,8,16).")
    length = parser.add_mutually_exclusive_group()
    length.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"Seconds of arrivals per run (default {DEFAULT_DURATION:g}).",
    )
    length.add_argument("--requests", type=int, default=None, help="Requests per run instead of a duration.")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--system-prompt-tokens", type=int, default=2000)
    parser.add_argument("--questions-per-group", type=int, default=16)
    parser.add_argument("--turns", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--out", default=str(ROOT / "var" / "bench" / "routing.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "routing.png"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.requests is None and args.duration is None:
        args.duration = DEFAULT_DURATION
    if not args.pods_url and not args.pod:
        parser.error("give --pods-url URL [--pods N] or --pod POD=URL (repeatable)")
    return args


def config_from(args: argparse.Namespace) -> LoadgenConfig:
    pods = fleet_from_base(args.pods_url, args.pods) if args.pods_url else {}
    pods.update(parse_pod(option) for option in args.pod)
    return LoadgenConfig(
        pods=pods,
        model=args.model,
        chat=not args.completions,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        seed=args.seed,
        score_url=args.score_url,
        api_key=args.api_key,
        alpha=args.alpha,
        reset_prefix_cache=True,
        settle=args.settle,
        workload=WorkloadSpec(
            groups=args.groups,
            system_prompt_tokens=args.system_prompt_tokens,
            questions_per_group=args.questions_per_group,
            turns=args.turns,
            seed=args.seed,
        ),
    )


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    config = config_from(args)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    ladder = parse_qps(args.qps)
    if args.duration is not None and any(math.isinf(q) for q in ladder):
        raise SystemExit("--qps inf sends everything at once: give --requests, not --duration")
    results = asyncio.run(
        run_ladder(
            config,
            routers=routers,
            qps=ladder,
            requests=args.requests,
            duration=args.duration,
            progress=partial(tqdm_progress, disable=args.no_progress),
        )
    )
    summaries = [summarize(step) for step in results]
    params = {"routers": routers, "qps": ladder, "requests": args.requests, "duration": args.duration}
    out = write_json(args.out, results_document(summaries, {**params, **config.describe()}))
    spec = config.workload
    title = (
        f"{len(config.pods)} pods, {spec.groups} groups x ~{spec.system_prompt_tokens}-token system prompt"
        + (f", {spec.turns} turns" if spec.turns > 1 else "")
    )
    image = plot(summaries, args.plot, title=title)
    print(render_table(summaries))
    for s in summaries:
        for note in s["notes"]:
            print(f"{s['router']} @ {s['qps']:g} qps: {note}")
    print(f"results: {out}\nplot: {image}")
    return summaries


if __name__ == "__main__":
    main()
