"""``python manage.py loadgen``: an OpenAI workload against a vLLM fleet, routed per request.

A thin shell around :mod:`simulator.loadgen`: it turns options into a ``LoadgenConfig`` and a
``WorkloadSpec``, runs every router (or, with ``--target``, the one target) at every QPS of the
ladder (``run_ladder``), prints the summary table and writes the JSON results. The formulas
behind each column are in ``simulator/loadgen/report.py``, the routers in
``simulator/loadgen/routers.py``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
from functools import partial

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from simulator.loadgen.report import LEGEND, pod_lines, render_table, results_document, summarize, write_json
from simulator.loadgen.routers import DEFAULT_ALPHA, ROUTER_NAMES
from simulator.loadgen.runner import (
    DEFAULT_MODEL,
    LoadgenConfig,
    default_score_url,
    fleet_from_base,
    parse_pod,
    parse_qps,
    parse_target,
    run_ladder,
    tqdm_progress,
)
from simulator.loadgen.trace import MOONCAKE_BLOCK_SIZE, TraceSpec, load_window
from simulator.loadgen.workload import WorkloadSpec

DEFAULT_MAX_TOKENS = 64


class Command(BaseCommand):
    help = (
        "Send a shared-prefix OpenAI workload to a vLLM fleet, choosing each request's pod with a "
        "router (kv, kv-load, least-loaded, random, round-robin) or sending every request to one "
        "OpenAI endpoint (--target: our gateway or a peer router), and report TTFT, latency, "
        "throughput and prefix-cache hit rates per router and QPS. The pods' prefix caches are left "
        "as they are unless --reset-prefix-cache. A legend under the table says what its columns "
        "measure; reuse~ is the workload's own prefix reuse, which bounds the fleet's hit rate only "
        "when the caches start empty and serve nothing else."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        fleet = parser.add_argument_group("fleet")
        fleet.add_argument(
            "--pods-url",
            metavar="URL",
            help="Base URL of pod sim-0, e.g. http://127.0.0.1:8100; pod sim-i is on its port + i.",
        )
        fleet.add_argument("--pods", type=int, default=None, metavar="N", help="Pod count with --pods-url.")
        fleet.add_argument(
            "--pod",
            action="append",
            default=[],
            metavar="POD=URL",
            help="A pod and its base URL, e.g. sim-0=http://127.0.0.1:8100 (repeatable).",
        )
        fleet.add_argument(
            "--target",
            metavar="URL",
            help=(
                "Send every request to this OpenAI server's /v1/chat/completions or /v1/completions "
                "(base URL, e.g. http://127.0.0.1:8200: a gateway or peer router) instead of routing "
                "with --router. Pods are then optional: given, they are scraped for the fleet hit rate "
                "(and reset with --reset-prefix-cache); the pod of a request is read from its "
                "x-kvcache-pod header."
            ),
        )
        fleet.add_argument(
            "--label",
            metavar="NAME",
            help="Name of the --target runs in the table and JSON (default target:<URL>).",
        )
        fleet.add_argument("--model", default=DEFAULT_MODEL, help=f"Model name (default {DEFAULT_MODEL}).")
        endpoint = fleet.add_mutually_exclusive_group()
        endpoint.add_argument(
            "--chat",
            dest="chat",
            action="store_true",
            default=True,
            help="Use /v1/chat/completions with messages (default).",
        )
        endpoint.add_argument(
            "--completions", dest="chat", action="store_false", help="Use /v1/completions with a prompt."
        )
        fleet.add_argument(
            "--no-stream",
            dest="stream",
            action="store_false",
            help="Ask for one JSON answer per request instead of an SSE stream (no TTFT then).",
        )
        fleet.add_argument(
            "--block-size",
            type=int,
            default=16,
            metavar="N",
            help="Tokens per KV block, to turn x-kvcache-matched-blocks into tokens (default 16).",
        )

        routing = parser.add_argument_group("routing")
        routing.add_argument(
            "--router",
            action="append",
            default=[],
            metavar="NAME[,NAME...]",
            help=f"Router(s) to run, each a full run: {', '.join(ROUTER_NAMES)} (default kv; repeatable).",
        )
        routing.add_argument(
            "--score-url",
            default=None,
            metavar="URL",
            help=(
                "Scoring API (default http://127.0.0.1:$WEB_PORT/api/v1/score: the web server of "
                "make run, which exports WEB_PORT; port 8000 when WEB_PORT is unset)."
            ),
        )
        routing.add_argument(
            "--api-key",
            default=None,
            help="Bearer key for the scoring API and the --target (our gateway takes the same keys; "
            "default: the first of KVCACHE_API_KEYS, if set).",
        )
        routing.add_argument(
            "--score-timeout", type=float, default=5.0, help="Seconds per score call (default 5)."
        )
        routing.add_argument(
            "--alpha",
            type=float,
            default=DEFAULT_ALPHA,
            help=f"kv-load: score/blocks - alpha * in-flight (default {DEFAULT_ALPHA}).",
        )
        routing.add_argument(
            "--no-observe-scores",
            dest="observe_scores",
            action="store_false",
            help="Do not call the scoring API for non-kv routers (no 'best pick' column for them).",
        )

        load = parser.add_argument_group("load")
        load.add_argument(
            "--qps",
            default=None,
            help=(
                "Requests per second (Poisson arrivals), or a ladder such as 2,4,8; inf = all at once "
                "(default 4). With --trace: the mean rate the trace's gaps are scaled to, bursts kept "
                "(default: the trace's own pace)."
            ),
        )
        length = load.add_mutually_exclusive_group()
        length.add_argument("--requests", type=int, default=None, help="Requests per run.")
        length.add_argument("--duration", type=float, default=None, help="Seconds of arrivals per run.")
        load.add_argument(
            "--concurrency", type=int, default=256, help="Requests in flight at most (default 256)."
        )
        load.add_argument(
            "--max-tokens",
            type=int,
            default=None,
            help=(
                "Output tokens per request (default 64). With --trace: a cap on the trace's output "
                "lengths, and the length of requests without one."
            ),
        )
        load.add_argument("--timeout", type=float, default=300.0, help="Seconds per request (default 300).")
        load.add_argument("--seed", type=int, default=0, help="Seed of the workload, arrivals and routers.")
        reset = load.add_mutually_exclusive_group()
        reset.add_argument(
            "--reset-prefix-cache",
            dest="reset_prefix_cache",
            action="store_true",
            default=False,
            help=(
                "POST /reset_prefix_cache to every pod before each run, so that each starts from "
                "empty caches: for a test fleet, never one serving real traffic."
            ),
        )
        reset.add_argument(
            "--keep-cache",
            dest="reset_prefix_cache",
            action="store_false",
            help="Leave the pods' prefix caches as they are (default).",
        )
        load.add_argument(
            "--settle",
            type=float,
            default=1.0,
            help="Seconds to wait after --reset-prefix-cache, for the index to catch up (default 1).",
        )

        workload = parser.add_argument_group("workload")
        workload.add_argument(
            "--groups", type=int, default=8, help="Groups sharing a system prompt (default 8)."
        )
        workload.add_argument(
            "--system-prompt-tokens", type=int, default=2000, help="Approximate system prompt length."
        )
        workload.add_argument(
            "--questions-per-group", type=int, default=16, help="Distinct sessions per group (default 16)."
        )
        workload.add_argument(
            "--question-tokens", type=int, default=24, help="Approximate user message length (default 24)."
        )
        workload.add_argument(
            "--turns", type=int, default=1, help="Turns per session; > 1 makes multi-turn chats."
        )
        workload.add_argument(
            "--active-sessions",
            type=int,
            default=0,
            help="Multi-turn sessions interleaved at a time (default 4 x groups).",
        )

        trace = parser.add_argument_group(
            "trace",
            "Replay a request trace instead of the generated workload: Mooncake's JSON Lines "
            "(timestamp ms, input_length, output_length, hash_ids) or ours (prompt or input_length, "
            "optional hash_ids and output_length); see simulator/loadgen/trace.py.",
        )
        trace.add_argument("--trace", metavar="FILE", help="The trace file (JSON Lines).")
        trace.add_argument(
            "--trace-block-size",
            type=int,
            default=MOONCAKE_BLOCK_SIZE,
            metavar="N",
            help=f"Tokens each hash id of the file stands for (default {MOONCAKE_BLOCK_SIZE}, Mooncake's).",
        )
        trace.add_argument(
            "--tokens-per-block",
            type=int,
            default=None,
            metavar="N",
            help="Tokens to send per hash id (default: the trace's block size); fewer scale every "
            "prompt down by the same factor, to fit a trace onto a smaller fleet.",
        )
        trace.add_argument(
            "--output-scale",
            type=float,
            default=1.0,
            metavar="F",
            help="Multiply the trace's output lengths by F (default 1).",
        )
        trace.add_argument(
            "--trace-start",
            type=float,
            default=0.0,
            metavar="SECONDS",
            help="Start the replay this far into the trace (its own time; default 0). --requests or "
            "--duration end it (default: the rest of the trace).",
        )
        trace.add_argument(
            "--spread-ties",
            action="store_true",
            help="Spread the requests that share a timestamp evenly over the gap to the next "
            "timestamp (the last ones over the trace's median gap), before any --qps rescaling: a "
            "coarse clock (Mooncake's conversation trace stamps every ~3 s) otherwise sends them "
            "all at one instant. Deterministic. Default: the trace's own timestamps.",
        )

        output = parser.add_argument_group("output")
        output.add_argument("--json-out", metavar="FILE", help="Write the results as JSON here.")
        output.add_argument("--no-progress", dest="progress", action="store_false", help="No progress bar.")

    def handle(self, *args, **options) -> None:
        # httpx logs every request at INFO: thousands of lines that would bury the progress bar.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        try:
            if options["target"] and options["router"]:
                raise ValueError(
                    "--target sends every request to URL, which routes it: drop --router "
                    "(or drop --target to route with loadgen)"
                )
            if options["label"] is not None and not options["target"]:
                raise ValueError("--label names the runs of a --target: give --target URL too")
            config = self.config(options)
            routers: list[str] = []
            if config.target is None:
                routers = [name.strip() for value in options["router"] or ["kv"] for name in value.split(",")]
                unknown = [name for name in routers if name not in ROUTER_NAMES]
                if unknown:
                    raise ValueError(f"unknown router {unknown[0]!r}: choose from {', '.join(ROUTER_NAMES)}")
            if options["qps"] is None and config.trace is not None:
                ladder: list[float | None] = [None]  # the trace's own pace
            else:
                ladder = parse_qps(options["qps"] or "4")
        except ValueError as e:
            raise CommandError(str(e)) from e

        requests, duration = options["requests"], options["duration"]
        if (requests is not None and requests < 1) or (duration is not None and not duration > 0):
            raise CommandError("--requests and --duration must be positive")
        if duration is not None and config.trace is None and any(math.isinf(q) for q in ladder):
            raise CommandError("--qps inf sends everything at once: give --requests, not --duration")
        for stop in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop, self._stopped)
        results = asyncio.run(
            run_ladder(
                config,
                routers=routers,
                qps=ladder,
                requests=requests,
                duration=duration,
                progress=partial(tqdm_progress, disable=not options["progress"]),
            )
        )
        summaries = [summarize(step) for step in results]
        self.stdout.write(render_table(summaries))
        self.stdout.write("\n".join(LEGEND))
        for summary in summaries:
            rate = "inf" if math.isinf(summary["qps"]) else f"{summary['qps']:.3g}"
            for line in pod_lines(summary):
                self.stdout.write(f"{summary['router']} @ {rate} qps: {line}")
            for note in summary["notes"]:
                self.stdout.write(f"{summary['router']} @ {rate} qps: {note}")
            for error, count in summary["errors"].items():
                self.stdout.write(f"{summary['router']} @ {rate} qps: {count} x {error}")
        if options["json_out"]:
            params = {
                "routers": routers or [config.target_name],
                "qps": ladder,
                "requests": requests,
                "duration": duration,
                **config.describe(),
            }
            path = write_json(options["json_out"], results_document(summaries, params))
            self.stdout.write(f"results: {path}")

    def _stopped(self, signum: int, frame: object) -> None:
        """Asked to stop (``make run``'s Ctrl-C): a clean end, exit 0, without the summary of a
        run that did not finish."""
        self.stderr.write(f"loadgen: {signal.Signals(signum).name}: stopped before the end of the run")
        raise SystemExit(0)

    @staticmethod
    def config(options: dict) -> LoadgenConfig:
        """The run configuration from the command's options; ValueError says what to fix."""
        pods: dict[str, str] = {}
        if options["pods_url"]:
            if options["pods"] is None:
                raise ValueError("--pods-url needs --pods N (how many pods, ports base..base+N-1)")
            pods.update(fleet_from_base(options["pods_url"], options["pods"]))
        elif options["pods"] is not None:
            raise ValueError("--pods needs --pods-url")
        for option in options["pod"]:
            pod, url = parse_pod(option)
            if pod in pods:
                raise ValueError(f"pod {pod!r} given twice")
            pods[pod] = url
        target = parse_target(options["target"]) if options["target"] else None
        if not pods and target is None:
            raise ValueError(
                "no pods: give --pods-url URL --pods N, or --pod POD=URL (repeatable), or --target URL"
            )
        api_key = options["api_key"]
        if api_key is None and settings.KVCACHE_API_KEYS:
            api_key = settings.KVCACHE_API_KEYS[0]
        trace = None
        if options["trace"]:
            trace = TraceSpec(
                path=options["trace"],
                block_size=options["trace_block_size"],
                tokens_per_block=options["tokens_per_block"],
                output_scale=options["output_scale"],
                max_output_tokens=options["max_tokens"],
                start=options["trace_start"],
                spread_ties=options["spread_ties"],
            )
            load_window(trace)  # a missing file or a bad line is an error now, not in the first run
        workload = WorkloadSpec(
            groups=options["groups"],
            system_prompt_tokens=options["system_prompt_tokens"],
            questions_per_group=options["questions_per_group"],
            question_tokens=options["question_tokens"],
            turns=options["turns"],
            seed=options["seed"],
            active_sessions=options["active_sessions"],
        )
        return LoadgenConfig(
            pods=pods,
            target=target,
            label=options["label"],
            model=options["model"],
            chat=options["chat"],
            stream=options["stream"],
            block_size=options["block_size"],
            max_tokens=options["max_tokens"] or DEFAULT_MAX_TOKENS,
            concurrency=options["concurrency"],
            seed=options["seed"],
            score_url=options["score_url"] or default_score_url(),
            api_key=api_key,
            score_timeout=options["score_timeout"],
            observe_scores=options["observe_scores"],
            alpha=options["alpha"],
            timeout=options["timeout"],
            reset_prefix_cache=options["reset_prefix_cache"],
            settle=options["settle"],
            workload=workload,
            trace=trace,
        )
