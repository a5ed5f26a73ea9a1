"""Scoring over HTTP under load: our endpoints beside a bare ASGI floor, in one run, side by side.

For each configuration a server is started on a free loopback port and driven by ``wrk`` (Debian's
package: ``make bench-deps``) at concurrency 1, 16 and 64 (one wrk thread at c=1, two above),
``--seconds`` per point:

* ``floor x1`` / ``floor xN``: ``bench/floor.py``, a bare ASGI app that reads the body and answers
  a fixed JSON body the size of our token_ids answer, under uvicorn with the options
  ``manage.py serve`` uses (httptools, no access log, the same event loop) and the same number
  of workers;
* ``memory x1``: our app with ``KVCACHE_INDEX_BACKEND=memory``, one worker process only;
* ``redis x1`` / ``redis xN``: our app with the Redis index (a throwaway Valkey server).

Each runs on asyncio's event loop, as ``manage.py serve`` does by default; a config named with
``@uvloop`` (``--configs memory-1@uvloop,floor-1@uvloop``) runs on uvloop instead (``serve
--loop uvloop``), compared with the floor on the same loop.

Our app is started by ``scoring_command``: ``manage.py serve`` when that command exists, else
uvicorn on ``kvsite.asgi`` (``--server`` forces either). Each server gets its own temp var dir
(``KVCACHE_VAR_DIR``), the run's sqlite database (migrated once) and a log file in the run's work
dir; it is stopped whatever happens (SIGTERM, SIGKILL after 10 s).

The index: 16 pods, each holding a different leading share of every prompt (a staircase: pod k
holds the first (k+1)/16 of its blocks), written with ``apply_updates``, the call ``ingest``
makes. For Redis this process writes it. The memory backend's index lives in the serving process,
so that process fills its own index and then runs the server command in-process
(``--serve-filled``). Only one worker can serve from it (every other worker process would start
with an empty index of its own): the memory backend is measured with one worker only. Before a
configuration is timed, one request per case must score all 16 pods; during the runs, every 200
answer must name a pod: no row measures a miss without saying so.

Before each run the server must be idle (under 5% of a core for 0.3 s): a run that leaves work
queued (cold prompts at c=64 still tokenizing after wrk closed its connections) would otherwise
slow the next one.

Cases (``/api/v1/score``, ``/score_completions``, ``/healthz`` as in the README):

* ``token_ids 2k`` (and ``token_ids 8k`` at c=1): the ids of one indexed prompt, no tokenizing;
* ``prompt warm 2k``: one indexed prompt again and again (a prefix-store hit);
* ``prompt cold 2k``: every request a prefix-store miss, tokenized in full, its blocks indexed.
  Prompt p of 64 distinct indexed prompts starts ``"Request p. " + PHRASE``; request n of a
  server sends prompt ``n % 64`` with the accented letters of ``PHRASE`` precomposed or
  decomposed by the bits of ``n // 64`` (the wrk script builds the bodies). The bytes differ, so
  the prefix store (keyed by bytes) misses; the tokenizer's NFC normalizer makes the tokens, so
  the block keys, those indexed (checked at start). A run starts where the server's previous run
  stopped: no request repeats (a row says so if the 1M spellings ran out);
* ``/healthz``: the lightest endpoint (the frame without the scoring core).

Isolation: while a client keeps one noise request in flight in a loop (a distinct 1 MB prompt to
``/score_completions``: over the model's context length, a 400 is a fine answer, a quick one is the
point; or a hostile ``chat_template`` to ``/score_chat_completions``), wrk measures
``token_ids 2k`` at c=1 and c=16; the same runs without noise, just before, give the p99 ratio.
The noise starts once wrk's connections are open (spread over the workers, as a scheduler's
long-lived connections are). wrk counts answered requests only, so a stall shows as answers
slower than ``STALL_S`` (counted as wrk timeouts) and as one probe request right after the run.
A server still busy with a noise request after its run is restarted before the next run.

The tokenizer alone is timed in this process (the floor of a cold prompt). Output: a table, a
verdict per target of issue 8, and ``var/bench/score.json``.

    make bench-deps     # Debian's wrk, once
    .venv/bin/python bench/score.py [--seconds 10] [--workers 2] [--configs memory-1,floor-1,...]
        [--concurrency 1,16,64] [--no-isolation] [--server auto|serve|uvicorn] [--keep]
    .venv/bin/python bench/score.py --url http://127.0.0.1:8000 [--redis-url redis://...] [--url-workers N]

With ``--url`` nothing is started: that server is measured as it runs (no floor, hash seed 42);
with ``--redis-url`` (its Redis index) the pods are indexed there first, else it must hold them.
The machine is noisy, and wrk and this process share its cores: compare rows of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import json
import math
import os
import random
import runpy
import shutil
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.machine import machine  # noqa: E402
from stack.asgi_server import HTTP_PROTOCOL  # noqa: E402

MODEL = "Qwen/Qwen3-0.6B"
SEED = "42"
BLOCK_SIZE = 16
PODS = 16
HOST = "127.0.0.1"
COLD_PROMPTS = 64
# Its accented letters are what a cold request varies: 14 of them, 16,384 spellings per prompt.
PHRASE = "Résumé: café, déjà vu, naïve, Zoë, señor, piñata, façade, crème brûlée."
NOISE_PROMPT_BYTES = 1_000_000
CHAT = [{"role": "user", "content": "Hello"}]
HOSTILE_TEMPLATES = {
    "template 10^8 loop": "{% for i in range(10000) %}{% for j in range(10000) %}x{% endfor %}{% endfor %}",
    "template 9**(9**8)": "{{ (9**(9**8)) % 2 }}",
}
# Issue 8's targets.
TOKEN_IDS_P50_MS = 1.5
TOKEN_IDS_OVER_FLOOR = 3.0
RPS_PER_WORKER = 1000.0
C16_P99_MS = 25.0
COLD_OVER_TOKENIZER_MS = 1.0
NOISE_P99_RATIO = 2.0
# With noise, an answer slower than this many seconds (or 4x the quiet p99) is a stall.
STALL_S = 2
FIXTURES = Path(os.environ.get("KVCACHE_FIXTURES", REPO.parent / "shared" / "fixtures"))
WRK_MISSING = "wrk is not installed: run `make bench-deps` (Debian's wrk package)"


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
    from kvindex import StoredBlock
    from kvindex.keys import chain_digests, key_of, root_digest

    digests = chain_digests(token_ids, block_size=BLOCK_SIZE, parent=root_digest(SEED))
    blocks = [StoredBlock(key_of(d), key_of(d), d) for d in digests]
    return [(f"pod-{k:02d}", blocks[: -(-len(blocks) * (k + 1) // pods)]) for k in range(pods)]


def fill(index, prompts: Sequence[Sequence[int]], pods: int) -> int:
    """Index every prompt on ``pods`` pods (staircase); returns the (pod, block) entries written."""
    from kvindex.base import Store

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


def json_escaped(text: str) -> str:
    """``text`` as it appears between the quotes of a JSON string (ASCII only)."""
    return json.dumps(text)[1:-1]


@dataclass(frozen=True)
class ColdPrompts:
    """``COLD_PROMPTS`` indexed prompts, each in 2^k byte spellings that tokenize the same.

    Prompt ``p``, spelling ``v``: ``heads[p] + PHRASE (letter i decomposed when bit i of v is
    set) + tails[p]``. Request ``n`` of a server is prompt ``n % prompts``, spelling
    ``n // prompts``; the wrk script builds the same bodies from ``data_lines``."""

    heads: tuple[str, ...]  # "Request 0007. "
    tail: str  # " " + the 2k shared text
    literals: tuple[str, ...]  # PHRASE between its accented letters (one more than the letters)
    letters: tuple[tuple[str, str], ...]  # (precomposed, decomposed) per accented letter
    token_ids: tuple[tuple[int, ...], ...]  # per prompt, as indexed

    @classmethod
    def build(cls, encode: Callable[[str], object], shared_text: str, *, prompts: int) -> ColdPrompts:
        literals, letters, run = [], [], []
        for char in PHRASE:
            decomposed = unicodedata.normalize("NFD", char)
            if decomposed == char:
                run.append(char)
            else:
                literals.append("".join(run))
                letters.append((char, decomposed))
                run = []
        literals.append("".join(run))
        heads = tuple(f"Request {p:04d}. " for p in range(prompts))
        self = cls(heads, " " + shared_text, tuple(literals), tuple(letters), ())
        ids = tuple(tuple(encode(self.text(p, 0)).ids) for p in range(prompts))
        self = replace(self, token_ids=ids)
        every = (1 << len(letters)) - 1
        for p, v in (
            (0, every),
            (1, 0b01010101010101),
            (prompts - 1, random.Random(1).getrandbits(len(letters))),
        ):
            if tuple(encode(self.text(p, v)).ids) != ids[p]:
                raise SystemExit(
                    "the tokenizer does not map the decomposed spellings to the same tokens (no NFC "
                    "normalizer?): cold prompts would not match the index"
                )
        return self

    @property
    def spellings(self) -> int:
        return 1 << len(self.letters)

    @property
    def capacity(self) -> int:
        """Distinct requests before a spelling repeats."""
        return len(self.heads) * self.spellings

    def phrase(self, v: int) -> str:
        """PHRASE with letter i decomposed when bit i of ``v`` is set."""
        out = [self.literals[0]]
        for i, letter in enumerate(self.letters):
            out += [letter[(v >> i) & 1], self.literals[i + 1]]
        return "".join(out)

    def text(self, p: int, v: int) -> str:
        return self.heads[p] + self.phrase(v) + self.tail

    def data_lines(self) -> list[str]:
        """What the wrk script reads: counts, the JSON around each prompt's phrase, the phrase's
        pieces, all JSON-escaped (one per line: escaped text has no newline)."""
        marker = "@@PHRASE@@"
        heads, tails = [], []
        for head in self.heads:
            body = json.dumps({"model": MODEL, "prompt": head + marker + self.tail})
            before, after = body.split(marker)
            heads.append(before)
            tails.append(after)
        return [
            str(len(self.heads)),
            str(len(self.letters)),
            *heads,
            *tails,
            *(json_escaped(s) for s in self.literals),
            *(json_escaped(a) for a, _ in self.letters),
            *(json_escaped(b) for _, b in self.letters),
        ]


@dataclass
class Workload:
    shared_2k: tuple[str, list[int]]
    ids_8k: list[int]
    cold: ColdPrompts
    check_prompt: tuple[str, list[int]]  # indexed, never sent by wrk: the cold case's check request
    noise_prompt: str

    @property
    def prompts(self) -> list[list[int]]:
        """Every token sequence the index holds."""
        return [self.shared_2k[1], self.ids_8k, self.check_prompt[1], *map(list, self.cold.token_ids)]


def build_workload() -> Workload:
    from tokenization.tokenizers import TokenizerRegistry

    tokenizer = TokenizerRegistry().get(MODEL)
    shared = make_prompt(tokenizer.encode, 2048, "Shared prompt")
    _, ids_8k = make_prompt(tokenizer.encode, 8192, "Long prompt")
    check = make_prompt(tokenizer.encode, 2048, "Check prompt")
    cold = ColdPrompts.build(tokenizer.encode, shared[0], prompts=COLD_PROMPTS)
    text = base_text()
    noise = (text * (NOISE_PROMPT_BYTES // len(text.encode()) + 1)).encode()[:NOISE_PROMPT_BYTES]
    return Workload(shared, ids_8k, cold, check, noise.decode(errors="ignore"))


def tokenizer_ms(cold: ColdPrompts, *, repeats: int = 100) -> float:
    """Median ms of the tokenizer alone on distinct cold prompts, in this process."""
    from tokenization.tokenizers import TokenizerRegistry

    tokenizer = TokenizerRegistry().get(MODEL)
    texts = [cold.text(n % len(cold.heads), 1 + n // len(cold.heads)) for n in range(repeats)]
    tokenizer.encode(texts[0])
    samples = []
    for text in texts:
        started = time.perf_counter()
        tokenizer.encode(text)
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


# --- servers -----------------------------------------------------------------------------------

# What ``manage.py serve`` passes to uvicorn, so the floor (and our app when served by uvicorn
# directly) runs under the same server: no access log (a line per request costs), "info" keeps
# the lifecycle lines, among them "Child process [pid] died" when the supervisor kills a worker
# that stopped answering its pings. Lifespan "auto" where serve says "on": an app without
# lifespan support (kvsite.asgi before the fast path) still starts. The HTTP protocol is serve's
# (httptools with TCP_NODELAY on every connection: stack/asgi_server.py).
UVICORN_OPTIONS = (
    *("--http", HTTP_PROTOCOL, "--ws", "websockets", "--lifespan", "auto"),
    *("--timeout-graceful-shutdown", "8", "--no-proxy-headers", "--no-access-log", "--log-level", "info"),
)


def uvicorn_command(app: str, *, port: int, workers: int, loop: str = "asyncio") -> list[str]:
    host_port = ["--host", HOST, "--port", str(port), "--workers", str(workers), "--loop", loop]
    return [sys.executable, "-m", "uvicorn", app, *host_port, *UVICORN_OPTIONS]


def scoring_command(*, port: int, workers: int, server: str = "auto", loop: str = "asyncio") -> list[str]:
    """How our app is served: ``manage.py serve`` once it exists (``server`` "auto"), else uvicorn
    on ``kvsite.asgi`` with the floor's options."""
    serve = (REPO / "scoring" / "management" / "commands" / "serve.py").is_file()
    if server == "serve" or (server == "auto" and serve):
        args = ["--host", HOST, "--port", str(port), "--workers", str(workers), "--loop", loop]
        return [sys.executable, "manage.py", "serve", *args]
    return uvicorn_command("kvsite.asgi:application", port=port, workers=workers, loop=loop)


def serve_filled(fill_path: str, argv: list[str]) -> None:
    """``--serve-filled FILL_JSON -- COMMAND...``: fill this process's index with the prompts of
    FILL_JSON, then run COMMAND (``python -m MODULE ...`` or ``python SCRIPT ...``) in this
    process, so that a one-worker server answers from the index filled here."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kvsite.settings")
    import django

    django.setup()
    from registry.runtime import get_index

    prompts = json.loads(Path(fill_path).read_text())
    fill(get_index(), prompts, PODS)
    # The fill made its objects at once; a full collection walking them all during the timed
    # runs would be a pause no steady-state server has: freeze them (as ingest does every second).
    del prompts
    gc.collect()
    gc.freeze()
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv[1:]
        runpy.run_path(argv[1], run_name="__main__")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """A server child process (its own process group, output to ``log``), ready when ``ready``
    answers 200; ``stop`` sends SIGTERM, then SIGKILL to the group after 10 s."""

    def __init__(self, argv: list[str], *, env: dict, log: Path, ready: str, timeout: float) -> None:
        self.argv, self.env, self.log_path, self.ready, self.timeout = argv, env, log, ready, timeout
        self.port = int(argv[argv.index("--port") + 1])
        self.url = f"http://{HOST}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        with self.log_path.open("a") as log:
            log.write(f"\n=== {' '.join(self.argv)}\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if http_get(self.url + self.ready, timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the server did not start: see {self.log_path}\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        with contextlib.suppress(ProcessLookupError):  # the leader or any worker it left behind
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def cpu_seconds(self) -> float:
        """CPU time used so far by every process of the server's group (leader and workers)."""
        if self.proc is None:
            return 0.0
        total = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rpartition(")")[2].split()
                if int(fields[2]) == self.proc.pid:  # the process group
                    total += int(fields[11]) + int(fields[12])  # utime + stime, in ticks
        return total / os.sysconf("SC_CLK_TCK")

    def settle(self, *, busy: float = 0.05, window: float = 0.3, limit: float = 15.0) -> float:
        """Wait until the server uses under ``busy`` of a core over ``window`` seconds (the work a
        run left queued, e.g. cold prompts still tokenizing after wrk closed its connections,
        must not land in the next run); at most ``limit`` seconds. Returns the seconds waited."""
        started = time.monotonic()
        before = self.cpu_seconds()
        while time.monotonic() - started < limit:
            time.sleep(window)
            now = self.cpu_seconds()
            if now - before < busy * window:
                break
            before = now
        return time.monotonic() - started

    def restart(self) -> None:
        """Stop, then start again on a new port (a killed worker may hold the old one a while)."""
        self.stop()
        self.port = free_port()
        self.argv[self.argv.index("--port") + 1] = str(self.port)
        self.url = f"http://{HOST}:{self.port}"
        self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def problems(self) -> list[str]:
        """Lines of the log that report an error (tracebacks, ERROR, worker deaths)."""
        words = ("Traceback", "ERROR", "Error:", "died", "Killed", "exception")
        return [
            line
            for line in self.log_path.read_text(errors="replace").splitlines()
            if any(w in line for w in words)
        ]


def http_get(url: str, *, timeout: float) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", parts.path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def http_post(url: str, path: str, body: bytes, *, timeout: float) -> tuple[int, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


# --- load: wrk and the noise client --------------------------------------------------------------

# One wrk run. Static bodies are sent as they are; cold bodies are built per request from the
# data file (see ColdPrompts). Every answer's status is counted, every 200 answer must contain
# `check` (a pod name), and done() writes the numbers to `result` for the bench to read.
WRK_SCRIPT = string.Template(r"""
local method, path, data, mode, check, result = "$method", "$path", "$data", "$mode", "$check", "$result"
local max_requests = $max_requests
local threads, created = {}, 0

function setup(thread)
  thread:set("id", created)
  created = created + 1
  table.insert(threads, thread)
end

wrk.method = method
wrk.path = path
if method == "POST" then wrk.headers["Content-Type"] = "application/json" end
if mode == "static" and data ~= "" then
  local f = assert(io.open(data, "rb"))
  wrk.body = f:read("*a")
  f:close()
end

function init(args)
  offset, nthreads = tonumber(args[1]), tonumber(args[2])
  sent, answered, statuses, unscored, sample = 0, 0, {}, 0, ""
  if mode == "cold" then
    local lines = {}
    for line in io.lines(data) do lines[#lines + 1] = line end
    prompts, letters = tonumber(lines[1]), tonumber(lines[2])
    heads, tails, literals, composed, decomposed = {}, {}, {}, {}, {}
    local at = 3
    for i = 1, prompts do heads[i] = lines[at]; at = at + 1 end
    for i = 1, prompts do tails[i] = lines[at]; at = at + 1 end
    for i = 1, letters + 1 do literals[i] = lines[at]; at = at + 1 end
    for i = 1, letters do composed[i] = lines[at]; at = at + 1 end
    for i = 1, letters do decomposed[i] = lines[at]; at = at + 1 end
  end
end

if mode == "cold" then
  function request()
    local n = offset + id + sent * nthreads
    sent = sent + 1
    local p = n % prompts
    local v = math.floor(n / prompts)
    local out = {heads[p + 1], literals[1]}
    for i = 1, letters do
      local spelled = composed
      if bit.band(bit.rshift(v, i - 1), 1) == 1 then spelled = decomposed end
      out[#out + 1] = spelled[i]
      out[#out + 1] = literals[i + 1]
    end
    out[#out + 1] = tails[p + 1]
    return wrk.format(nil, nil, nil, table.concat(out))
  end
end

function response(status, headers, body)
  answered = answered + 1
  statuses[status] = (statuses[status] or 0) + 1
  if status ~= 200 then
    if sample == "" then sample = status .. " " .. string.sub(body or "", 1, 300) end
  elseif check ~= "" and not string.find(body, check, 1, true) then
    unscored = unscored + 1
  end
  if answered >= max_requests then wrk.thread:stop() end
end

function done(summary, latency, requests)
  local f = assert(io.open(result, "w"))
  local e = summary.errors
  f:write(string.format("requests %d\nduration_us %d\n", summary.requests, summary.duration))
  f:write(string.format("errors %d %d %d %d %d\n", e.connect, e.read, e.write, e.status, e.timeout))
  for _, q in ipairs({50, 90, 99, 99.9}) do
    f:write(string.format("p%s %d\n", tostring(q), latency:percentile(q)))
  end
  f:write(string.format("max %d\nmean %f\n", latency.max, latency.mean))
  local codes, most_sent, capped = {}, 0, 0
  for _, t in ipairs(threads) do
    for code, n in pairs(t:get("statuses")) do codes[code] = (codes[code] or 0) + n end
    f:write(string.format("unscored %d\n", t:get("unscored")))
    most_sent = math.max(most_sent, t:get("sent"))
    if t:get("answered") >= max_requests then capped = 1 end
    local s = t:get("sample")
    if s ~= "" then f:write("sample " .. string.gsub(s, "[\r\n]", " ") .. "\n") end
  end
  for code, n in pairs(codes) do f:write(string.format("status %d %d\n", code, n)) end
  f:write(string.format("most_sent %d\ncapped %d\n", most_sent, capped))
  f:close()
end
""")


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    path: str
    body: bytes | None = None  # None with GET, or for the cold case (built by wrk)
    check: str = '"pod-00"'  # every 200 answer contains this ("" to skip)
    concurrency: tuple[int, ...] = (1, 16, 64)
    cold: bool = False


@dataclass
class Wrk:
    """Runs wrk against one server; the cold case's requests continue from run to run."""

    url: str
    workdir: Path
    seconds: int
    cold: ColdPrompts | None = None
    cold_sent: int = 0
    runs: int = 0
    max_requests: int = 2_000_000  # per wrk thread and run: a bound besides the time

    def run(
        self,
        case: Case,
        connections: int,
        *,
        seconds: int | None = None,
        timeout: int | None = None,
        noise: Noise | None = None,
    ) -> dict:
        """One wrk run of ``case`` over ``connections`` connections. Answers slower than ``timeout``
        seconds are counted as timeouts, not latencies (default: longer than the run). With
        ``noise``, the noise client starts once wrk's connections are open (so they are spread
        over the workers as a scheduler's long-lived connections are) and stops after the run."""
        wrk = shutil.which("wrk")
        if wrk is None:
            raise SystemExit(WRK_MISSING)
        seconds = seconds or self.seconds
        threads = 1 if connections == 1 else 2
        self.runs += 1
        stem = self.workdir / f"wrk-{self.runs:03d}"
        data = ""
        if case.cold:
            data = str(stem.with_suffix(".cold"))
            Path(data).write_text("\n".join(self.cold.data_lines()) + "\n")
        elif case.body is not None:
            data = str(stem.with_suffix(".body"))
            Path(data).write_bytes(case.body)
        result = stem.with_suffix(".result")
        script = stem.with_suffix(".lua")
        script.write_text(
            WRK_SCRIPT.substitute(
                method=case.method,
                path=case.path,
                data=data,
                mode="cold" if case.cold else "static",
                check=case.check.replace('"', '\\"'),
                result=str(result),
                max_requests=self.max_requests,
            )
        )
        offset = self.cold_sent
        argv = [wrk, f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency"]
        argv += [f"--timeout={timeout or 2 * seconds + 10}s", "-s", str(script), self.url + case.path]
        argv += ["--", str(offset), str(threads)]
        client = None
        with (self.workdir / "wrk.log").open("a") as log:
            log.write(f"\n=== {case.name} c={connections}: {' '.join(argv)}\n")
            log.flush()
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
            try:
                if noise is not None:
                    time.sleep(0.3)
                    noise.start()
                proc.wait(seconds + 60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                if noise is not None:
                    client = noise.stop()
        if proc.returncode:
            raise SystemExit(f"wrk failed ({proc.returncode}): see {self.workdir / 'wrk.log'}")
        out = parse_wrk_result(result.read_text())
        if case.cold:
            self.cold_sent = offset + out.pop("most_sent") * threads
            out["repeated"] = max(0, self.cold_sent - self.cold.capacity)
        else:
            out.pop("most_sent")
        if client is not None:
            out["noise_client"] = client
        return out


def parse_wrk_result(text: str) -> dict:
    """The file the wrk script's done() writes -> figures in ms and req/s."""
    out: dict = {"statuses": {}, "unscored": 0, "samples": []}
    for line in text.splitlines():
        key, _, rest = line.partition(" ")
        if key == "status":
            code, n = rest.split()
            out["statuses"][code] = int(n)
        elif key == "unscored":
            out["unscored"] += int(rest)
        elif key == "sample":
            out["samples"].append(rest)
        elif key == "errors":
            names = ("connect", "read", "write", "status", "timeout")
            out["socket_errors"] = dict(zip(names, map(int, rest.split()), strict=True))
        else:
            out[key] = float(rest)
    requests, duration = int(out.pop("requests")), out.pop("duration_us") / 1e6
    # No answer at all: wrk reports zeros, which are no latency.
    latency = {
        f"{k}_ms": out.pop(k) / 1e3 if requests else None
        for k in ("p50", "p90", "p99", "p99.9", "max", "mean")
    }
    return {
        "requests": requests,
        "seconds": round(duration, 3),
        "rps": requests / duration if duration else 0.0,
        **latency,
        "non_200": sum(n for code, n in out["statuses"].items() if code != "200"),
        "statuses": out["statuses"],
        "socket_errors": out["socket_errors"],
        "unscored": out["unscored"],
        "samples": out["samples"][:2],
        "capped": bool(out["capped"]),
        "most_sent": int(out["most_sent"]),
    }


class Noise:
    """A client keeping one request in flight, in a loop, until stopped or ``max_requests`` sent;
    request ``n`` sends ``body(n)``.

    On ``stop`` the request in flight has ``grace`` seconds to be answered; one still unanswered
    then is abandoned (its connection closed) and reported: the server is still busy with it."""

    def __init__(
        self, url: str, path: str, body: Callable[[int], bytes], *, max_requests: int = 10_000
    ) -> None:
        self.url, self.path, self.body, self.max_requests = url, path, body, max_requests
        self.statuses: Counter[str] = Counter()
        self.latencies_ms: list[float] = []
        self.errors: Counter[str] = Counter()
        self.in_flight_since: float | None = None
        self.sent = 0
        self._stop = threading.Event()
        self._aborted = False
        self._conn: http.client.HTTPConnection | None = None
        self._thread = threading.Thread(target=self._loop, name="noise", daemon=True)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 5
        while self.in_flight_since is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def _loop(self) -> None:
        parts = urlsplit(self.url)
        headers = {"Content-Type": "application/json"}
        while not self._stop.is_set() and self.sent < self.max_requests:
            self._conn = conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=3600)
            started = time.perf_counter()
            self.in_flight_since = time.monotonic()
            self.sent += 1
            try:
                conn.request("POST", self.path, body=self.body(self.sent), headers=headers)
                response = conn.getresponse()
                response.read()
            except (OSError, http.client.HTTPException) as exc:
                if not self._aborted:
                    self.errors[type(exc).__name__] += 1
                    self._stop.wait(0.1)
                continue
            finally:
                conn.close()
            self.in_flight_since = None
            self.statuses[str(response.status)] += 1
            self.latencies_ms.append((time.perf_counter() - started) * 1e3)

    def stop(self, *, grace: float = 5.0) -> dict:
        self._stop.set()
        self._thread.join(grace)
        unanswered = None
        if self._thread.is_alive():
            since = self.in_flight_since
            unanswered = time.monotonic() - since if since is not None else grace
            self._aborted = True
            conn = self._conn
            if conn is not None and conn.sock is not None:
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
            self._thread.join(5)
        lat = sorted(self.latencies_ms)
        return {
            "sent": self.sent,
            "answered": len(lat),
            "statuses": dict(self.statuses),
            "errors": dict(self.errors),
            "p50_ms": statistics.median(lat) if lat else None,
            "max_ms": lat[-1] if lat else None,
            "unanswered_s": round(unanswered, 1) if unanswered is not None else None,
        }


def probe_ms(url: str, case: Case, *, timeout: float) -> float | None:
    """One ``case`` request on a new connection: ms, or None when not answered within ``timeout``.
    Sent right after a noisy run, it shows a server stalled when the run ended (wrk counts
    answered requests only)."""
    started = time.perf_counter()
    try:
        http_post(url, case.path, case.body or b"", timeout=timeout)
    except OSError:
        return None
    return (time.perf_counter() - started) * 1e3


# --- measuring -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    backend: str  # floor | memory | redis | url
    workers: int
    loop: str = "asyncio"

    @property
    def name(self) -> str:
        return f"{self.backend} x{self.workers}" + ("" if self.loop == "asyncio" else f" {self.loop}")


def parse_configs(text: str) -> list[Config]:
    configs = []
    for item in text.split(","):
        spec, _, loop = item.strip().partition("@")
        backend, _, workers = spec.partition("-")
        if backend not in ("floor", "memory", "redis") or not workers.isdigit():
            raise SystemExit(f"--configs: {item!r} is not floor-N, memory-1 or redis-N")
        if backend == "memory" and workers != "1":
            raise SystemExit("--configs: the memory backend is one index per process: memory-1 only")
        if loop not in ("", "asyncio", "uvloop"):
            raise SystemExit(f"--configs: {item!r}: the loop after @ is asyncio or uvloop")
        configs.append(Config(backend, int(workers), loop or "asyncio"))
    return configs


def body_of(**fields: object) -> bytes:
    return json.dumps({"model": MODEL, **fields}, separators=(",", ":")).encode()


def our_cases(workload: Workload, concurrency: tuple[int, ...]) -> list[Case]:
    text, ids = workload.shared_2k
    return [
        Case("token_ids 2k", "POST", "/api/v1/score", body_of(token_ids=ids), concurrency=concurrency),
        Case("token_ids 8k", "POST", "/api/v1/score", body_of(token_ids=workload.ids_8k), concurrency=(1,)),
        Case("prompt warm 2k", "POST", "/score_completions", body_of(prompt=text), concurrency=concurrency),
        Case("prompt cold 2k", "POST", "/score_completions", concurrency=concurrency, cold=True),
        Case("/healthz", "GET", "/healthz", check='"ok"', concurrency=concurrency),
    ]


def floor_case(workload: Workload, concurrency: tuple[int, ...]) -> Case:
    body = body_of(token_ids=workload.shared_2k[1])
    return Case("floor (token_ids 2k body)", "POST", "/api/v1/score", body, check="", concurrency=concurrency)


def noise_bodies(workload: Workload) -> dict[str, tuple[str, Callable[[int], bytes]]]:
    """Noise name -> (path, body of request n): a distinct 1 MB prompt each time (a repeated one
    would be a prefix-store hit after the first), or a hostile template."""

    def big_prompt(n: int) -> bytes:
        return body_of(prompt=f"Noise {n}. {workload.noise_prompt}")

    out = {"1 MB prompt": ("/score_completions", big_prompt)}
    for name, template in HOSTILE_TEMPLATES.items():
        body = body_of(messages=CHAT, chat_template=template)
        out[name] = ("/score_chat_completions", lambda n, body=body: body)
    return out


def check_server(url: str, workload: Workload) -> int:
    """One request per scoring case must score all the pods, and a chat must be answered (which
    also loads the chat-template machinery before any noise); returns the token_ids answer's size."""
    status, answer = http_post(url, "/score_chat_completions", body_of(messages=CHAT), timeout=60)
    if status != 200:
        raise SystemExit(f"check chat: /score_chat_completions answered {status}: {answer[:300]!r}")
    checks = {
        "token_ids 2k": ("/api/v1/score", body_of(token_ids=workload.shared_2k[1])),
        "token_ids 8k": ("/api/v1/score", body_of(token_ids=workload.ids_8k)),
        "prompt 2k": ("/score_completions", body_of(prompt=workload.shared_2k[0])),
        "a prompt like the cold ones": ("/score_completions", body_of(prompt=workload.check_prompt[0])),
        "a cold prompt's token_ids": ("/api/v1/score", body_of(token_ids=list(workload.cold.token_ids[-1]))),
    }
    size = 0
    for name, (path, body) in checks.items():
        status, answer = http_post(url, path, body, timeout=60)
        if status != 200:
            raise SystemExit(f"check {name}: {path} answered {status}: {answer[:300]!r}")
        parsed = json.loads(answer)
        scored = parsed.get("scores", parsed)  # /api/v1/score's detail, or upstream's bare object
        if len(scored) != PODS:
            raise SystemExit(
                f"check {name}: {path} scored {len(scored)} pods, not the {PODS} indexed: "
                "the run would measure a miss"
            )
        size = size or len(answer)
    return size


def row_of(config: Config, case: Case, c: int, result: dict, **extra: object) -> dict:
    where = {"config": config.name, "backend": config.backend, "workers": config.workers, "loop": config.loop}
    return {**where, "case": case.name, "c": c, **result, **extra}


def warm_up(wrk: Wrk, cases: Sequence[Case], seconds: int) -> None:
    """Untimed: a short run at c=16 of every case but the cold one (loads the tokenizer in every
    worker, puts the warm prompt in every worker's prefix store)."""
    for case in cases:
        if not case.cold:
            wrk.run(case, 16, seconds=seconds)


def measure_config(
    config: Config, server: Server | None, url: str, workload: Workload, args: argparse.Namespace, tmp: Path
) -> tuple[list[dict], list[dict], int]:
    """The rows of one configuration, its isolation rows, and its token_ids answer's size."""
    concurrency = tuple(args.concurrency)
    rundir = tmp / config.name.replace(" ", "")
    rundir.mkdir(exist_ok=True)
    wrk = Wrk(url, rundir, args.seconds, cold=workload.cold)
    rows: list[dict] = []
    if config.backend == "floor":
        case = floor_case(workload, concurrency)
        wrk.run(case, 16, seconds=args.warmup)
        for c in concurrency:
            rows.append(row_of(config, case, c, wrk.run(case, c)))
            print_progress(rows[-1])
        return rows, [], 0
    answer_bytes = check_server(url, workload)
    cases = our_cases(workload, concurrency)
    warm_up(wrk, cases, args.warmup)
    for c in concurrency:
        for case in cases:
            if c in case.concurrency:
                if server is not None:
                    server.settle()  # what the previous run left queued is done before this one
                rows.append(row_of(config, case, c, wrk.run(case, c)))
                print_progress(rows[-1])
    isolation = [] if args.no_isolation else measure_isolation(config, server, wrk, cases[0], workload)
    return rows, isolation, answer_bytes


def measure_isolation(
    config: Config, server: Server | None, wrk: Wrk, small: Case, workload: Workload
) -> list[dict]:
    """``small`` at c=1 and c=16, quiet, then with each noise kept in flight. Answers slower than
    ``STALL_S`` (or 4x the quiet p99) count as timeouts: wrk counts only answered requests, so
    a request stuck when the run ends shows only that way. A server still busy with a noise
    request after the run is restarted (started servers) before the next run."""
    levels = [c for c in (1, 16) if c in small.concurrency] or [1]
    out: list[dict] = []
    quiet = {c: wrk.run(small, c) for c in levels}
    for c in levels:
        out.append(row_of(config, small, c, quiet[c], noise="none"))
        print_progress(out[-1])
    for name, (path, body) in noise_bodies(workload).items():
        for c in levels:
            timeout = max(STALL_S, math.ceil(4 * (quiet[c]["p99_ms"] or 0) / 1e3))
            noisy = wrk.run(small, c, timeout=timeout, noise=Noise(wrk.url, path, body))
            noisy["probe_after_ms"] = probe_ms(wrk.url, small, timeout=timeout)
            ratio = None
            if noisy["requests"] and quiet[c]["requests"]:
                ratio = noisy["p99_ms"] / quiet[c]["p99_ms"]
            out.append(row_of(config, small, c, noisy, noise=name, p99_ratio=ratio, stall_s=timeout))
            print_progress(out[-1])
            busy = noisy["noise_client"]["unanswered_s"] is not None
            if server is not None and (busy or not server.alive()):
                server.restart()
                wrk.url = server.url
                check_server(server.url, workload)
                warm_up(wrk, [small], 1)
                out[-1]["restarted_after"] = True
    return out


def print_progress(row: dict) -> None:
    case = row["case"] + (f" + {row['noise']}" if row.get("noise", "none") != "none" else "")
    print(
        f"  {row['config']:<16} {case:<40} c={row['c']:<3} {row['rps']:>8.0f} req/s "
        f"p50 {ms(row['p50_ms'])} p99 {ms(row['p99_ms'])} ms{notes(row)}",
        flush=True,
    )


def server_env(backend: str, *, redis_url: str, database: Path, var_dir: Path, floor_bytes: int) -> dict:
    var_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "kvsite.settings",
        "KVCACHE_INDEX_BACKEND": "memory" if backend == "memory" else "redis",
        "REDIS_URL": redis_url,
        "DATABASE_URL": f"sqlite:///{database}",
        "KVCACHE_VAR_DIR": str(var_dir),
        "KVCACHE_HASH_SEED": SEED,
        "KVCACHE_API_KEYS": "",
        "HF_HUB_OFFLINE": "1",
        "DEBUG": "false",
        "LOG_LEVEL": "WARNING",
        "PYTHONUNBUFFERED": "1",
    }
    if floor_bytes:
        env["KVBENCH_FLOOR_BYTES"] = str(floor_bytes)
    return env


def migrate(env: dict, log: Path) -> None:
    with log.open("a") as out:
        done = subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    if done.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise SystemExit(f"manage.py migrate failed (see {log}):\n{tail}")


def start_server(
    config: Config, *, args: argparse.Namespace, tmp: Path, redis_url: str, fill_path: Path, floor_bytes: int
) -> Server:
    port = free_port()
    if config.backend == "floor":
        argv = uvicorn_command("bench.floor:app", port=port, workers=config.workers, loop=config.loop)
        ready = "/healthz"
    else:
        argv = scoring_command(port=port, workers=config.workers, server=args.server, loop=config.loop)
        ready = "/readyz"
    if config.backend == "memory":
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve-filled", str(fill_path), "--", *argv]
    name = config.name.replace(" ", "")
    env = server_env(
        config.backend,
        redis_url=redis_url,
        database=tmp / "db.sqlite3",
        var_dir=tmp / f"var-{name}",
        floor_bytes=floor_bytes,
    )
    server = Server(argv, env=env, log=tmp / f"server-{name}.log", ready=ready, timeout=args.start_timeout)
    print(f"{config.name}: {' '.join(argv[1:])}", flush=True)
    server.start()
    return server


def run_started(workload: Workload, args: argparse.Namespace, info: dict) -> None:
    """Every configuration of ``--configs``, each on its own server, always stopped. The work dir
    (server logs, wrk scripts and output) is removed unless ``--keep`` or a run failed."""
    from kvindex import open_index
    from tests.servers import RedisServer

    configs = parse_configs(args.configs)
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-score-"))
    print(f"work dir {tmp}", flush=True)
    failed = True
    redis_server = RedisServer()
    try:
        migrate_env = server_env(
            "redis",
            redis_url=redis_server.url,
            database=tmp / "db.sqlite3",
            var_dir=tmp / "var",
            floor_bytes=0,
        )
        migrate(migrate_env, tmp / "migrate.log")
        fill_path = tmp / "fill.json"
        fill_path.write_text(json.dumps(workload.prompts))
        if any(c.backend == "redis" for c in configs):
            index = open_index(redis_server.url)
            fill(index, workload.prompts, PODS)
            index.close()
        answer_bytes = 0  # the floor answers as many bytes as our token_ids answer, once known
        for config in configs:
            server = start_server(
                config,
                args=args,
                tmp=tmp,
                redis_url=redis_server.url,
                fill_path=fill_path,
                floor_bytes=answer_bytes,
            )
            if config.backend != "floor":
                info["server_command"] = " ".join(server.argv[1:]).replace(str(server.port), "PORT")
            try:
                rows, isolation, size = measure_config(config, server, server.url, workload, args, tmp)
            finally:
                server.stop()
            answer_bytes = answer_bytes or size
            problems = server.problems()
            info["rows"] += rows
            info["isolation"] += isolation
            info["servers"][config.name] = {
                "starts": server.starts,
                "answer_bytes": size or len(floor_answer(answer_bytes)),
                "problem_lines": len(problems),
                "problems": problems[:50],
            }
        failed = False
    finally:
        redis_server.stop()
        if failed or args.keep:
            print(f"server logs and wrk output kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def floor_answer(size: int) -> bytes:
    from bench.floor import answer_body

    return answer_body(size=size or None)


def run_url(workload: Workload, args: argparse.Namespace, info: dict) -> None:
    """``--url``: the cases (and the isolation check) against a server that is already running."""
    if args.redis_url:
        from kvindex import open_index

        index = open_index(args.redis_url)
        fill(index, workload.prompts, PODS)
        index.close()
    config = Config("url", args.url_workers)
    with tempfile.TemporaryDirectory(prefix="kvbench-score-") as tmp:
        rows, isolation, size = measure_config(config, None, args.url.rstrip("/"), workload, args, Path(tmp))
    info["rows"] += rows
    info["isolation"] += isolation
    info["servers"][config.name] = {"url": args.url, "answer_bytes": size}


# --- report ------------------------------------------------------------------------------------


def ms(value: float | None, width: int = 0) -> str:
    return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"


def notes(row: dict) -> str:
    """What went wrong in a run, if anything."""
    out = []
    if not row["requests"]:
        out.append("NO ANSWER")
    if row["non_200"]:
        out.append(f"non-200 {row['statuses']} e.g. {row['samples'][:1]}")
    errors = {k: v for k, v in row["socket_errors"].items() if v and k != "status"}
    if timeouts := errors.pop("timeout", 0):
        out.append(f"{timeouts} wrk timeouts (an answer over {row.get('stall_s', '-')} s, or none)")
    if errors:
        out.append(f"socket errors {errors}")
    if "probe_after_ms" in row and row["probe_after_ms"] is None:
        out.append(f"a request right after the run unanswered in {row['stall_s']} s")
    if row["unscored"]:
        out.append(f"{row['unscored']} answers without pods")
    if row.get("repeated"):
        out.append(f"{row['repeated']} prompts repeated")
    if row["capped"]:
        out.append("request cap hit")
    return ("  " + "; ".join(out)) if out else ""


def clean(row: dict) -> bool:
    """Answers came, all 200 with pods, no socket error or timeout, no stall after the run."""
    errors = sum(v for k, v in row["socket_errors"].items() if k != "status")
    stalled = "probe_after_ms" in row and row["probe_after_ms"] is None
    return bool(row["requests"]) and not (row["non_200"] or row["unscored"] or errors or stalled)


def floor_p50(rows: Sequence[dict], workers: int, c: int, loop: str = "asyncio") -> float | None:
    for row in rows:
        same = row["workers"] == workers and row["c"] == c and row.get("loop", "asyncio") == loop
        if row["backend"] == "floor" and same:
            return row["p50_ms"]
    return None


def print_table(info: dict) -> None:
    m, p = info["machine"], info["params"]
    start, end = (
        " ".join(f"{x:.2f}" for x in m[k]) for k in ("load_average_at_start", "load_average_at_end")
    )
    print(f"\nmachine: {m['cpu']}, {m['cores']} cores, python {m['python']}; {info['date']}")
    print(
        f"load:    1/5/15-min load average {start} at start, {end} at end (wrk and the bench share the cores)"
    )
    print(f"server:  {info.get('server_command', '-')}; {p['seconds']} s per point")
    print(f"tokenizer alone (a cold 2k prompt, in the bench process): {info['tokenizer_ms']:.2f} ms\n")
    head = f"{'config':<16} {'case':<26} {'c':>3} {'req/s':>8} {'p50 ms':>7} {'p90':>7} {'p99':>7} x floor"
    print(head)
    print("-" * len(head))
    rows = info["rows"]
    for row in rows:
        floor = floor_p50(rows, row["workers"], row["c"], row.get("loop", "asyncio"))
        ratio = "-"
        if floor and row["p50_ms"] is not None and row["backend"] != "floor":
            ratio = f"{row['p50_ms'] / floor:.2f}"
        figures = f"{row['rps']:>8.0f} {ms(row['p50_ms'], 7)} {ms(row['p90_ms'], 7)} {ms(row['p99_ms'], 7)}"
        print(f"{row['config']:<16} {row['case']:<26} {row['c']:>3} {figures} {ratio:>7}{notes(row)}")
    print(
        "x floor: p50 over the floor's p50 at the same c and worker count (the floor answers the POST "
        "of the token_ids 2k body)"
    )
    if info["isolation"]:
        print("\nisolation: token_ids 2k while one noise request is kept in flight (x quiet: p99 ratio)")
        head = f"{'config':<16} {'noise':<20} {'c':>3} {'req/s':>8} {'p50 ms':>7} {'p99':>8} {'x quiet':>7}"
        print(head + "  noise client")
        print("-" * (len(head) + 14))
        for row in info["isolation"]:
            ratio = f"{row['p99_ratio']:.2f}" if row.get("p99_ratio") is not None else "-"
            figures = f"{row['rps']:>8.0f} {ms(row['p50_ms'], 7)} {ms(row['p99_ms'], 8)} {ratio:>7}"
            where = f"{row['config']:<16} {row['noise']:<20} {row['c']:>3}"
            print(f"{where} {figures}  {noise_summary(row)}{notes(row)}")
    for name, server in info["servers"].items():
        if server.get("problem_lines"):
            lines, first = server["problem_lines"], server["problems"][:3]
            print(f"\n{name}: {lines} error lines in the server log, the first: {first}")


def noise_summary(row: dict) -> str:
    client = row.get("noise_client")
    if not client:
        return ""
    out = f"{client['answered']}/{client['sent']} answered {client['statuses']}"
    if client["p50_ms"] is not None:
        out += f", p50 {client['p50_ms']:.0f} ms, max {client['max_ms']:.0f} ms"
    if client["unanswered_s"] is not None:
        out += f", one still unanswered after {client['unanswered_s']:.1f} s"
    if client["errors"]:
        out += f", errors {client['errors']}"
    if row.get("restarted_after"):
        out += " (server restarted)"
    return out


def verdicts(info: dict) -> list[dict]:
    """One verdict per target of issue 8 and configuration measured (never met by a run with
    errors, non-200 answers, answers without pods or a stall)."""
    rows, out = info["rows"], []

    def find(config: str, case: str, c: int) -> dict | None:
        return next((r for r in rows if r["config"] == config and r["case"] == case and r["c"] == c), None)

    def add(config: str, target: str, met: bool, numbers: str) -> None:
        out.append({"config": config, "target": target, "met": met, "numbers": numbers})

    for config in dict.fromkeys(r["config"] for r in rows if r["backend"] != "floor"):
        first = next(r for r in rows if r["config"] == config)
        workers, loop = first["workers"], first.get("loop", "asyncio")
        if (row := find(config, "token_ids 2k", 1)) and row["requests"]:
            p50 = row["p50_ms"]
            target = f"token_ids 2k at c=1: p50 <= {TOKEN_IDS_P50_MS} ms"
            add(config, target, p50 <= TOKEN_IDS_P50_MS and clean(row), f"p50 {p50:.2f} ms")
            if floor := floor_p50(rows, workers, 1, loop):
                target = f"token_ids 2k at c=1: p50 <= {TOKEN_IDS_OVER_FLOOR:g}x the floor's"
                numbers = f"p50 {p50:.2f} ms = {p50 / floor:.1f}x the floor's {floor:.2f} ms"
                add(config, target, p50 <= TOKEN_IDS_OVER_FLOOR * floor and clean(row), numbers)
        if (row := find(config, "token_ids 2k", 16)) and row["requests"]:
            per_worker = row["rps"] / workers
            target = f"token_ids 2k at c=16: >= {RPS_PER_WORKER:,.0f} req/s per worker"
            numbers = f"{per_worker:,.0f} req/s per worker ({row['rps']:,.0f} over {workers})"
            add(config, target, per_worker >= RPS_PER_WORKER and clean(row), numbers)
            target = f"token_ids 2k at c=16: p99 <= {C16_P99_MS:g} ms"
            add(config, target, row["p99_ms"] <= C16_P99_MS and clean(row), f"p99 {row['p99_ms']:.2f} ms")
        if (row := find(config, "prompt cold 2k", 1)) and row["requests"]:
            limit = info["tokenizer_ms"] + COLD_OVER_TOKENIZER_MS
            numbers = f"p50 {row['p50_ms']:.2f} ms, tokenizer alone {info['tokenizer_ms']:.2f} ms"
            target = f"prompt cold 2k at c=1: p50 <= tokenizer + {COLD_OVER_TOKENIZER_MS:g} ms"
            add(config, target, row["p50_ms"] <= limit and clean(row), numbers)
        for row in info["isolation"]:
            if row["config"] != config or row["noise"] == "none":
                continue
            ratio = row["p99_ratio"]
            met = ratio is not None and ratio <= NOISE_P99_RATIO and clean(row)
            numbers = f"p99 {ms(row['p99_ms'])} ms = {ratio:.2f}x quiet" if ratio is not None else "no answer"
            if row["socket_errors"]["timeout"] or row["probe_after_ms"] is None:
                numbers += f", answers over {row['stall_s']} s"
            if errors := {
                k: v for k, v in row["socket_errors"].items() if v and k not in ("status", "timeout")
            }:
                numbers += f", socket errors {errors}"
            target = f"c={row['c']} with {row['noise']} in flight: p99 <= {NOISE_P99_RATIO:g}x quiet"
            add(config, target, met, numbers)
    return out


def print_verdicts(found: Sequence[dict]) -> None:
    if found:
        print("\ntargets (issue 8):")
    for v in found:
        print(f"  {v['config']:<16} {'met   ' if v['met'] else 'MISSED'}  {v['target']}: {v['numbers']}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-filled"]:
        serve_filled(argv[1], argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=10, help="wrk seconds per point (default 10)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed wrk seconds per case and server")
    parser.add_argument(
        "--workers", type=int, default=2, help="N: worker processes of the multi-worker configs"
    )
    parser.add_argument("--configs", help="comma-separated floor-N, memory-1, redis-N (default: all five)")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated connection counts")
    parser.add_argument("--no-isolation", action="store_true", help="skip the isolation check")
    parser.add_argument(
        "--server", choices=("auto", "serve", "uvicorn"), default="auto", help="how our app runs"
    )
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server has to start")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (server logs, wrk output)")
    parser.add_argument("--url", help="measure this running server instead of starting any")
    parser.add_argument("--redis-url", help="with --url: the server's Redis index, to index the pods into")
    parser.add_argument("--url-workers", type=int, default=1, help="with --url: its worker processes")
    parser.add_argument("--out", type=Path, default=REPO / "var" / "bench" / "score.json")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    n = args.workers
    args.configs = args.configs or f"memory-1,floor-1,redis-1,floor-{n},redis-{n}"
    if shutil.which("wrk") is None:
        raise SystemExit(WRK_MISSING)
    os.environ["HF_HUB_OFFLINE"] = "1"

    workload = build_workload()
    info: dict = {
        "benchmark": "scoring over HTTP under load (wrk)",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "params": {
            "model": MODEL,
            "pods": PODS,
            "seconds": args.seconds,
            "concurrency": args.concurrency,
            "configs": "url" if args.url else args.configs,
            "cold_prompts": COLD_PROMPTS,
            "cold_prompt_tokens": len(workload.cold.token_ids[0]),
            "tokens": {"token_ids 2k": len(workload.shared_2k[1]), "token_ids 8k": len(workload.ids_8k)},
            "noise_prompt_bytes": len(workload.noise_prompt.encode()),
            "hostile_templates": HOSTILE_TEMPLATES,
        },
        "tokenizer_ms": tokenizer_ms(workload.cold),
        "rows": [],
        "isolation": [],
        "servers": {},
    }
    print(f"tokenizer alone: {info['tokenizer_ms']:.2f} ms per cold 2k prompt", flush=True)
    if args.url:
        run_url(workload, args, info)
    else:
        run_started(workload, args, info)
    info["machine"]["load_average_at_end"] = os.getloadavg()
    info["verdicts"] = verdicts(info)
    print_table(info)
    print_verdicts(info["verdicts"])
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=2) + "\n")
    print(f"\nresults written to {out}")


if __name__ == "__main__":
    main()
