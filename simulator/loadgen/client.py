"""The HTTP side of loadgen: send one OpenAI completion (streamed or not), ask for scores, read
pod metrics.

Failures are values, not exceptions: a completion that fails comes back as a
:class:`Completion` with ``ok`` False and an ``error`` that says what happened (HTTP status and
the OpenAI error message, a transport error, a stream cut before ``[DONE]``); a score call that
fails raises :class:`~simulator.loadgen.routers.ScoreUnavailable` for the router to fall back.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from simulator.loadgen.routers import Scores, ScoreUnavailable

DONE = "[DONE]"
_LINE_END = re.compile(rb"\r\n|\r|\n")

# The /metrics samples loadgen reads (summed over labels).
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"

# Response headers of a router in front of the fleet (our gateway sets them): the pod that
# served the request and the blocks of its prompt that the index predicted that pod holds.
POD_HEADER = "x-kvcache-pod"
SIMULATED_POD_HEADER = "x-simulated-pod"
"""What a simulated pod names itself by: routers that pass upstream headers through (the peers)
name the pod with it when they set no pod header of their own."""
MATCHED_BLOCKS_HEADER = "x-kvcache-matched-blocks"


class SSEDecoder:
    """Incremental Server-Sent Events decoder: feed it bytes as they arrive, get back the
    ``data`` of each complete event. Chunk boundaries may fall anywhere, including inside a
    line ending or a UTF-8 character; ``\\n``, ``\\r\\n`` and ``\\r`` all end lines, comment lines
    (``:``) and other fields are skipped, multi-line data is joined with ``\\n``."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        position = 0
        while match := _LINE_END.search(self._buffer, position):
            if match.group() == b"\r" and match.end() == len(self._buffer):
                break  # a "\n" may follow in the next chunk
            line = self._buffer[position : match.start()]
            position = match.end()
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            name, _, value = line.partition(b":")
            if name == b"data":
                self._data.append(value.removeprefix(b" ").decode("utf-8"))
        self._buffer = self._buffer[position:]
        return events

    def close(self) -> list[str]:
        """The last event when the stream ended without its blank line."""
        events = self.feed(b"\n\n") if self._buffer or self._data else []
        self._buffer = b""
        return events


def chunk_text(chunk: dict) -> str:
    """The generated text in one streamed chunk: ``delta.content`` (chat) or ``text``
    (completions) of the first choice; "" for role, finish and usage chunks."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def error_detail(raw: bytes) -> str:
    """The message of an error body: OpenAI's ``{"error": {"message"}}``, vLLM's older flat
    ``{"message"}``, DRF's ``{"detail"}``, else the body as text (truncated)."""
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    detail = raw.decode("utf-8", "replace").strip()
    if isinstance(body, dict):
        error = body["error"] if isinstance(body.get("error"), dict) else body
        detail = str(error.get("message") or error.get("detail") or detail)
    return detail[:200]


def error_message(status: int, raw: bytes) -> str:
    """A one-line description of an HTTP error answer."""
    detail = error_detail(raw)
    return f"HTTP {status}: {detail}" if detail else f"HTTP {status}"


@dataclass(frozen=True)
class Completion:
    """One completion as the client saw it. Times in seconds from sending the request: ``ttft``
    to the first chunk carrying generated text (None when not streamed: no first chunk to see),
    ``e2e`` to ``data: [DONE]`` or to the whole JSON answer. ``pod`` and ``matched_blocks`` are
    what the response headers said (:data:`POD_HEADER`, :data:`MATCHED_BLOCKS_HEADER`), None
    without them."""

    ok: bool
    status: int | None
    ttft: float | None
    e2e: float | None
    output_tokens: int
    prompt_tokens: int | None
    cached_tokens: int | None
    text: str
    error: str | None = None
    pod: str | None = None
    matched_blocks: int | None = None


@dataclass(frozen=True)
class ServedBy:
    """Who served a response, by its headers; None for what a header did not say (or said
    unreadably: a matched-blocks value that is not a non-negative integer)."""

    pod: str | None = None
    matched_blocks: int | None = None

    @classmethod
    def from_headers(cls, headers: httpx.Headers) -> ServedBy:
        pod = (headers.get(POD_HEADER, "") or headers.get(SIMULATED_POD_HEADER, "")).strip() or None
        raw = headers.get(MATCHED_BLOCKS_HEADER, "").strip()
        matched = int(raw) if raw.isdigit() else None
        return cls(pod=pod, matched_blocks=matched)


async def send_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    *,
    clock: Callable[[], float] = time.perf_counter,
    headers: dict[str, str] | None = None,
) -> Completion:
    """POST ``body`` to ``url`` (with ``headers``): read the SSE stream to ``[DONE]`` when
    ``body["stream"]`` is set, else the one JSON answer."""
    if body.get("stream"):
        return await stream_completion(client, url, body, clock=clock, headers=headers)
    return await fetch_completion(client, url, body, clock=clock, headers=headers)


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    *,
    clock: Callable[[], float] = time.perf_counter,
    headers: dict[str, str] | None = None,
) -> Completion:
    """POST ``body`` (with ``stream`` set) to ``url`` and read the SSE stream to ``[DONE]``.

    Output tokens come from the usage chunk when the server sends one, else one per text chunk.
    """
    start = clock()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict | None = None
    status: int | None = None
    served = ServedBy()

    def failed(error: str) -> Completion:
        return _failed(status, ttft, clock() - start, "".join(parts), len(parts), error, served)

    def finished() -> Completion:
        return _finished(status, ttft, clock() - start, "".join(parts), len(parts), usage, served)

    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            status = response.status_code
            served = ServedBy.from_headers(response.headers)
            if status != 200:
                return failed(error_message(status, await response.aread()))
            decoder = SSEDecoder()
            async for raw in response.aiter_bytes():
                for data in decoder.feed(raw):
                    if data == DONE:
                        return finished()
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        return failed(f"bad SSE data: {data[:80]!r}")
                    if not isinstance(chunk, dict):
                        return failed(f"bad SSE data: {data[:80]!r}")
                    if "error" in chunk:
                        return failed(f"error in stream: {error_detail(data.encode())}")
                    if text := chunk_text(chunk):
                        if ttft is None:
                            ttft = clock() - start
                        parts.append(text)
                    if chunk.get("usage"):
                        usage = chunk["usage"]
            for data in decoder.close():
                if data == DONE:
                    return finished()
            return failed("stream ended before [DONE]")
    except httpx.HTTPError as e:
        return failed(f"{type(e).__name__}: {e}".rstrip(": "))
    except UnicodeDecodeError as e:
        return failed(f"SSE data is not UTF-8: {e}")


async def fetch_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    *,
    clock: Callable[[], float] = time.perf_counter,
    headers: dict[str, str] | None = None,
) -> Completion:
    """POST ``body`` (``stream`` false) to ``url`` and read the one JSON answer; ``ttft`` is
    None. Output tokens come from its usage, else 1 if it has any text (a lower bound)."""
    start = clock()
    status: int | None = None
    served = ServedBy()

    def failed(error: str) -> Completion:
        return _failed(status, None, clock() - start, "", 0, error, served)

    try:
        response = await client.post(url, json=body, headers=headers)
    except httpx.HTTPError as e:
        return failed(f"{type(e).__name__}: {e}".rstrip(": "))
    status = response.status_code
    served = ServedBy.from_headers(response.headers)
    if status != 200:
        return failed(error_message(status, response.content))
    try:
        answer = response.json()
        choice = answer["choices"][0]
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return failed(f"unexpected completion answer: {response.text[:80]!r}")
    text = text if isinstance(text, str) else ""
    usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else None
    return _finished(status, None, clock() - start, text, int(bool(text)), usage, served)


def _failed(
    status: int | None,
    ttft: float | None,
    e2e: float,
    text: str,
    output_tokens: int,
    error: str,
    served: ServedBy,
) -> Completion:
    return Completion(
        ok=False,
        status=status,
        ttft=ttft,
        e2e=e2e,
        output_tokens=output_tokens,
        prompt_tokens=None,
        cached_tokens=None,
        text=text,
        error=error,
        pod=served.pod,
        matched_blocks=served.matched_blocks,
    )


def _finished(
    status: int | None,
    ttft: float | None,
    e2e: float,
    text: str,
    chunks: int,
    usage: dict | None,
    served: ServedBy,
) -> Completion:
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        ok=True,
        status=status,
        ttft=ttft,
        e2e=e2e,
        output_tokens=int(usage.get("completion_tokens", chunks)),
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        text=text,
        pod=served.pod,
        matched_blocks=served.matched_blocks,
    )


async def fetch_scores(
    client: httpx.AsyncClient,
    url: str,
    query: dict,
    *,
    api_key: str | None = None,
    timeout: float = 5.0,
) -> Scores:
    """POST ``query`` to the scoring API; raises ScoreUnavailable with the reason on failure."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await client.post(url, json=query, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise ScoreUnavailable(f"{type(e).__name__}: {e}".rstrip(": ")) from e
    if response.status_code != 200:
        raise ScoreUnavailable(error_message(response.status_code, response.content))
    try:
        answer = response.json()
        scores = {str(pod): float(score) for pod, score in answer["scores"].items()}
        blocks = int(answer.get("blocks") or 0)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ScoreUnavailable(f"unexpected score answer: {response.text[:120]!r}") from e
    return Scores(blocks=blocks, by_pod=scores)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> value per sample name, summed over label sets."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def scrape_metrics(
    client: httpx.AsyncClient, base_url: str, *, timeout: float = 5.0
) -> dict[str, float]:
    """``GET <base_url>/metrics``, parsed; raises httpx.HTTPError or ValueError on failure."""
    response = await client.get(f"{base_url}/metrics", timeout=timeout)
    response.raise_for_status()
    return parse_metrics(response.text)


async def scrape_fleet(client: httpx.AsyncClient, pods: dict[str, str]) -> dict[str, dict[str, float] | None]:
    """Every pod's metrics at once; None for a pod that did not answer."""

    async def one(url: str) -> dict[str, float] | None:
        try:
            return await scrape_metrics(client, url)
        except (httpx.HTTPError, ValueError):
            return None

    answers = await asyncio.gather(*(one(url) for url in pods.values()))
    return dict(zip(pods, answers, strict=True))


async def reset_prefix_cache(client: httpx.AsyncClient, pods: dict[str, str]) -> list[str]:
    """``POST /reset_prefix_cache`` on every pod; the pods that refused or did not answer."""

    async def one(url: str) -> bool:
        try:
            response = await client.post(f"{url}/reset_prefix_cache", timeout=10.0)
        except httpx.HTTPError:
            return False
        return response.is_success

    answers = await asyncio.gather(*(one(url) for url in pods.values()))
    return [pod for pod, ok in zip(pods, answers, strict=True) if not ok]
