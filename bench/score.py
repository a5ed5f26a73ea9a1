"""Scoring latency over HTTP, end to end, with where the time goes and the floor beside it.

For each backend, a web server (daphne, ``kvsite.asgi``, as ``make run`` starts it) is started
on a free port with 16 pods indexed, each holding a different leading share of every prompt
(pod k holds the first (k+1)/16 of its blocks), and this process sends requests one at a time
over one keep-alive connection:

* ``prompt cold``  - ``/score_completions`` with a distinct prompt each time (a prefix-store miss:
  tokenized in full), every prompt indexed;
* ``prompt warm``  - ``/score_completions`` with one prompt again and again (a prefix-store hit);
* ``token_ids``    - ``/api/v1/score`` with the prompt's token ids (no tokenization);

for prompts of 2k and 8k tokens. Each response's ``Server-Timing`` header gives the core's
breakdown (tokenize, keys, lookup, score); ``framework`` is the client's latency minus the core's
time (HTTP, daphne, Django, DRF, JSON, this client). Beside them, measured in the same run in
this process: the tokenizer alone, the key chain alone, one Redis round trip (PING, and the MGET
of the prompt's keys) or the in-memory lookup alone, and an HTTP round trip to ``/healthz``
(the framework's floor).

    .venv/bin/python bench/score.py [--backends memory,redis] [--requests 200] [--out FILE]
    .venv/bin/python bench/score.py --url http://host:8000 [--redis-url redis://...]

With ``--url`` the server is not started: it is measured as it is; with ``--redis-url`` (the
server's Redis index) the pods are indexed there first.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402

MODEL = "Qwen/Qwen3-0.6B"
SEED = "42"
BLOCK_SIZE = 16
PODS = 16
SIZES = {"2k": 2048, "8k": 8192}
CASES = ("prompt cold", "prompt warm", "token_ids")
TARGETS = {  # p50 targets in ms, for 2k-token prompts
    ("2k", "prompt cold"): 5.0,
    ("2k", "prompt warm"): 2.0,
    ("2k", "token_ids"): 2.0,
}
P99_OVER_P50_TARGET = 3.0
FIXTURES = Path(os.environ.get("KVCACHE_FIXTURES", REPO.parent / "shared" / "fixtures"))


# --- workload --------------------------------------------------------------------------------


def base_text() -> str:
    capture = FIXTURES / "vllm" / "kv_event_base.json"
    if capture.is_file():
        return json.loads(capture.read_text())["prompt"]
    return (
        "Prefix caching lets an inference engine reuse the attention keys and values of a prompt's "
        "leading tokens when another request starts the same way, so routing requests to the pod "
        "that already holds their prefix saves most of the prefill work. "
    ) * 8


def make_prompt(encode: Callable[[str], object], tokens: int, tag: str) -> tuple[str, list[int]]:
    """About ``tokens`` tokens of English text starting with ``tag`` (cut at a token boundary)."""
    paragraph = base_text()
    parts, i = [f"{tag}."], 0
    while len(" ".join(parts)) < tokens * 6:
        parts.append(f"Section {i}. {paragraph}")
        i += 1
    text = " ".join(parts)
    encoding = encode(text)
    text = text[: encoding.offsets[tokens][0]]
    return text, encode(text).ids


def staircase(token_ids: Sequence[int], pods: int) -> list[tuple[str, list]]:
    """(pod, blocks) for every pod: pod k holds the first (k+1)/pods of the prompt's blocks."""
    from scoring.index import StoredBlock
    from scoring.keys import chain_digests, key_of, root_digest

    digests = chain_digests(token_ids, block_size=BLOCK_SIZE, parent=root_digest(SEED))
    blocks = [StoredBlock(key_of(d), key_of(d), d) for d in digests]
    return [(f"pod-{k:02d}", blocks[: -(-len(blocks) * (k + 1) // pods)]) for k in range(pods)]


def fill(index, prompts: Sequence[Sequence[int]], pods: int) -> int:
    """Index every prompt on ``pods`` pods (staircase); returns the (pod, block) entries written."""
    from scoring.index.base import Store

    entries, batch = 0, []
    for token_ids in prompts:
        for pod, blocks in staircase(token_ids, pods):
            batch.append(Store(MODEL, pod, "gpu", blocks))
            entries += len(blocks)
        if len(batch) >= 64:
            index.apply_updates(batch)
            batch = []
    if batch:
        index.apply_updates(batch)
    return entries


# --- the server ----------------------------------------------------------------------------------


def serve(argv: list[str]) -> None:
    """``--serve PORT FILL_JSON``: migrate a fresh database, index the prompts of FILL_JSON into
    this process's index (the memory backend lives here), then run daphne in this process."""
    port, fill_path = argv
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvsite.settings")
    import django

    django.setup()
    from django.core.management import call_command

    from scoring import services

    call_command("migrate", verbosity=0, interactive=False)
    prompts = json.loads(Path(fill_path).read_text())
    fill(services.get_index(), prompts, PODS)
    # The fill just created a million objects at once (the memory backend's entries), which the
    # next full garbage collection would walk during the timed requests (a 100-300 ms pause). A
    # process that grows its index from events gets a full collection each time the index grows
    # by a quarter, not at once: freeze what the fill made, so the run measures that steady state.
    del prompts
    gc.collect()
    gc.freeze()
    from daphne.cli import CommandLineInterface

    CommandLineInterface().run(["-b", "127.0.0.1", "-p", port, "kvsite.asgi:application"])


class Server:
    """A daphne child process for one backend, with its own database and pods indexed."""

    def __init__(self, *, backend: str, redis_url: str, prompts: list[list[int]], workdir: Path) -> None:
        from tests.servers import free_port

        self.port = free_port()
        fill_path = workdir / f"fill-{backend}.json"
        fill_path.write_text(json.dumps(prompts))
        env = {
            **os.environ,
            "KVCACHE_INDEX_BACKEND": backend,
            "REDIS_URL": redis_url,
            "DATABASE_URL": f"sqlite:///{workdir / f'{backend}.sqlite3'}",
            "KVCACHE_HASH_SEED": SEED,
            "KVCACHE_API_KEYS": "",
            "HF_HUB_OFFLINE": "1",
            "DEBUG": "false",
            "LOG_LEVEL": "WARNING",
        }
        self.log = (workdir / f"server-{backend}.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", str(self.port), str(fill_path)],
            env=env,
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/readyz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the server did not start: see {self.log.name}")
            time.sleep(0.2)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# --- measuring ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def server_timing(header: str) -> dict[str, float]:
    """``Server-Timing`` -> {step: ms}."""
    steps = {}
    for part in header.split(","):
        name, _, rest = part.strip().partition(";")
        for attr in rest.split(";"):
            if attr.startswith("dur="):
                steps[name] = float(attr[4:])
    return steps


def run_case(url: str, path: str, bodies: Sequence[bytes], *, warmup: Sequence[bytes]) -> dict:
    """Send the ``warmup`` bodies untimed, then ``bodies`` in order, timed; latency figures."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    headers = {"Content-Type": "application/json"}

    def send(body: bytes) -> tuple[float, dict[str, float], bytes]:
        started = time.perf_counter()
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        elapsed = (time.perf_counter() - started) * 1e3
        if response.status != 200:
            raise SystemExit(f"{path} answered {response.status}: {data[:300]!r}")
        return elapsed, server_timing(response.getheader("Server-Timing", "")), data

    for body in warmup:
        send(body)
    samples, steps, last = [], [], b""
    gc.disable()
    try:
        for body in bodies:
            elapsed, timing, last = send(body)
            samples.append(elapsed)
            steps.append(timing)
    finally:
        gc.enable()
        conn.close()
    answer = json.loads(last)
    scored = answer.get("scores", answer)  # /api/v1/score's detail, or upstream's bare object
    if len(scored) != PODS:
        raise SystemExit(f"{path} scored {len(scored)} pods, not the {PODS} indexed: the run measured a miss")
    framework = [s - t.get("core", 0.0) for s, t in zip(samples, steps, strict=True)]
    breakdown = {
        name: statistics.median(t.get(name, 0.0) for t in steps)
        for name in ("tokenize", "keys", "lookup", "score")
    }
    breakdown["framework"] = statistics.median(framework)
    p50, p99 = percentile(samples, 50), percentile(samples, 99)
    return {
        "requests": len(samples),
        "p50_ms": p50,
        "p99_ms": p99,
        "p99_over_p50": p99 / p50,
        "mean_ms": statistics.fmean(samples),
        "breakdown_p50_ms": breakdown,
        "pods_scored": len(scored),
    }


def time_ms(fn: Callable[[], object], *, repeats: int = 50) -> float:
    """Median ms of ``fn`` over ``repeats`` calls (after one untimed call)."""
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def floors(
    *, texts: dict[str, str], ids: dict[str, list[int]], url: str, backend: str, redis_url: str
) -> dict:
    """The cost of each step alone, in this process: what no server can beat."""
    from scoring.index import open_index
    from scoring.keys import block_keys
    from scoring.tokenization import TokenizerRegistry

    registry = TokenizerRegistry()
    tokenizer = registry.get(MODEL)
    out: dict[str, dict[str, float]] = {}
    for size, text in texts.items():
        keys = block_keys(ids[size], seed=SEED, block_size=BLOCK_SIZE)
        warm = TokenizerRegistry()
        warm.tokenize(MODEL, text)
        row = {
            "tokenizer_ms": time_ms(lambda text=text: tokenizer.encode(text)),
            "prefix_store_hit_ms": time_ms(lambda text=text, warm=warm: warm.tokenize(MODEL, text)),
            "keys_ms": time_ms(lambda size=size: block_keys(ids[size], seed=SEED, block_size=BLOCK_SIZE)),
        }
        if backend == "redis":
            index = open_index(redis_url)
            client = index._client  # the raw client: one round trip, nothing of ours around it
            names = [b"kv:{%s}:b:%016x" % (MODEL.replace("/", "%2F").encode(), k) for k in keys]
            row["redis_ping_ms"] = time_ms(client.ping, repeats=200)
            row["redis_mget_ms"] = time_ms(lambda names=names, client=client: client.mget(names))
            row["lookup_ms"] = time_ms(lambda keys=keys, index=index: index.lookup(model=MODEL, keys=keys))
            index.close()
        else:
            index = open_index("memory://")
            fill(index, [ids[size]], PODS)
            row["lookup_ms"] = time_ms(lambda keys=keys, index=index: index.lookup(model=MODEL, keys=keys))
        out[size] = row
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)

    def healthz() -> None:
        conn.request("GET", "/healthz")
        conn.getresponse().read()

    out["http"] = {"healthz_ms": time_ms(healthz, repeats=200)}
    conn.close()
    return out


def measure(url: str, *, backend: str, workload: dict, requests: int, redis_url: str) -> dict:
    results: dict[str, dict] = {}
    for size in SIZES:
        shared_text, shared_ids = workload["shared"][size]
        cold = [json.dumps({"model": MODEL, "prompt": t}).encode() for t, _ in workload["cold"][size]]
        warm = [json.dumps({"model": MODEL, "prompt": shared_text}).encode()] * requests
        by_ids = [json.dumps({"model": MODEL, "token_ids": shared_ids}).encode()] * requests
        # Warm-up (untimed): loads the tokenizer and stores the shared prompt's chunks; the cold
        # prompts are never sent before they are timed, so each is a prefix-store miss.
        results[size] = {
            "prompt cold": run_case(url, "/score_completions", cold, warmup=warm[:5]),
            "prompt warm": run_case(url, "/score_completions", warm, warmup=warm[:5]),
            "token_ids": run_case(url, "/api/v1/score", by_ids, warmup=by_ids[:5]),
        }
    texts = {size: workload["shared"][size][0] for size in SIZES}
    ids = {size: workload["shared"][size][1] for size in SIZES}
    return {
        "cases": results,
        "floors": floors(texts=texts, ids=ids, url=url, backend=backend, redis_url=redis_url),
    }


# --- report ------------------------------------------------------------------------------------


def verdicts(size: str, case: str, row: dict) -> str:
    marks = []
    target = TARGETS.get((size, case))
    if target is not None:
        marks.append(f"p50<={target:g}:{'ok' if row['p50_ms'] <= target else 'MISS'}")
    marks.append(f"p99<=3x:{'ok' if row['p99_over_p50'] <= P99_OVER_P50_TARGET else 'MISS'}")
    return " ".join(marks)


def floor_for(case: str, floor: dict, backend: str) -> str:
    lookup = (
        f"mget {floor['redis_mget_ms']:.2f}" if backend == "redis" else f"lookup {floor['lookup_ms']:.2f}"
    )
    tokenize = {
        "prompt cold": f"tok {floor['tokenizer_ms']:.2f}",
        "prompt warm": f"store {floor['prefix_store_hit_ms']:.2f}",
        "token_ids": "",
    }[case]
    return " + ".join(p for p in (tokenize, f"keys {floor['keys_ms']:.2f}", lookup) if p)


def print_table(info: dict) -> None:
    m = info["machine"]
    print(f"machine: {m['cpu']}, {m['cores']} cores, python {m['python']}")
    start, end = (
        " ".join(f"{x:.2f}" for x in m[k]) for k in ("load_average_at_start", "load_average_at_end")
    )
    print(f"load:    1/5/15-min load average {start} at start, {end} at end (other work skews p99)")
    print(f"date:    {info['date']}")
    p = info["params"]
    print(f"{p['pods']} pods (staircase), {p['requests']} sequential requests per case, one connection\n")
    head = (
        f"{'backend':<7} {'size':<4} {'case':<11} {'p50':>6} {'p99':>6} {'p99/50':>6} | {'tok':>5} "
        f"{'keys':>5} {'lookup':>6} {'score':>5} {'frame':>5} | {'floor (ms, same run)':<36} verdict"
    )
    print(head)
    print("-" * len(head))
    for backend, result in info["results"].items():
        for size, cases in result["cases"].items():
            floor = result["floors"][size]
            for case, row in cases.items():
                b = row["breakdown_p50_ms"]
                print(
                    f"{backend:<7} {size:<4} {case:<11} {row['p50_ms']:>6.2f} {row['p99_ms']:>6.2f} "
                    f"{row['p99_over_p50']:>6.2f} | {b['tokenize']:>5.2f} {b['keys']:>5.2f} "
                    f"{b['lookup']:>6.2f} {b['score']:>5.2f} {b['framework']:>5.2f} | "
                    f"{floor_for(case, floor, backend):<36} "
                    f"{verdicts(size, case, row)}"
                )
        http_floor = result["floors"]["http"]["healthz_ms"]
        extra = ""
        if backend == "redis":
            extra = f", Redis PING {result['floors']['2k']['redis_ping_ms']:.3f} ms"
        print(f"{backend:<7} floor: HTTP round trip to /healthz {http_floor:.2f} ms{extra}")
    print(
        "\nms; breakdown = medians of the Server-Timing steps; frame = client latency - core time "
        "(HTTP, daphne, Django, DRF, JSON, client)."
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        serve(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="memory,redis", help="comma-separated: memory, redis")
    parser.add_argument("--url", help="measure this running server instead of starting one")
    parser.add_argument("--redis-url", help="with --url: the server's Redis index, to index the pods into")
    parser.add_argument("--requests", type=int, default=200, help="timed requests per case")
    parser.add_argument("--out", type=Path, default=REPO / "var" / "bench" / "score.json")
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"

    from scoring.tokenization import TokenizerRegistry

    tokenizer = TokenizerRegistry().get(MODEL)
    workload: dict[str, dict] = {"shared": {}, "cold": {}}
    for size, n in SIZES.items():
        workload["shared"][size] = make_prompt(tokenizer.encode, n, "Shared prompt")
        workload["cold"][size] = [
            make_prompt(tokenizer.encode, n, f"Request {i}") for i in range(args.requests)
        ]
    prompts = [
        ids
        for size in SIZES
        for ids in [workload["shared"][size][1]] + [i for _, i in workload["cold"][size]]
    ]

    info = {
        "benchmark": "scoring over HTTP",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "params": {
            "model": MODEL,
            "pods": PODS,
            "requests": args.requests,
            "tokens": SIZES,
            "targets_p50_ms": {f"{s} {c}": t for (s, c), t in TARGETS.items()},
            "p99_over_p50_target": P99_OVER_P50_TARGET,
        },
        "results": {},
    }
    if args.url:
        backend = "redis" if args.redis_url else "external"
        if args.redis_url:
            from scoring.index import open_index

            fill(open_index(args.redis_url), prompts, PODS)
        info["results"][backend] = measure(
            args.url,
            backend=backend,
            workload=workload,
            requests=args.requests,
            redis_url=args.redis_url or "",
        )
    else:
        from tests.servers import RedisServer

        with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
            redis_server = RedisServer()
            try:
                for backend in args.backends.split(","):
                    redis_server.flush()
                    server = Server(
                        backend=backend, redis_url=redis_server.url, prompts=prompts, workdir=Path(tmp)
                    )
                    try:
                        info["results"][backend] = measure(
                            server.url,
                            backend=backend,
                            workload=workload,
                            requests=args.requests,
                            redis_url=redis_server.url,
                        )
                    finally:
                        server.stop()
            finally:
                redis_server.stop()

    info["machine"]["load_average_at_end"] = os.getloadavg()
    print_table(info)
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=2) + "\n")
    print(f"results written to {out}")


if __name__ == "__main__":
    main()
