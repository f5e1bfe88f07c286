"""A light closed-loop HTTP load generator: N workers, one JSON request each in flight.

One event loop, one aiohttp connection pool: each of ``concurrency`` workers sends its
next request as soon as its previous answer came back, so at most ``concurrency`` are
in flight and the offered load follows the server's pace (closed loop). Bodies are
encoded once before the clock starts, so the generator spends its CPU on sockets only,
which matters when it shares two cores with the server it measures. Every request's
send time, latency, status and error (if any) are recorded; a non-2xx status, a
connection error or a timeout counts as an error, never as a latency.

Used by ``perf.peers`` for every system alike (Triton's KServe v2 JSON, OpenAI-style
``/embeddings``, a Ray Serve route): only the URL and the body differ.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

#: A request that takes longer than this is recorded as an error (``timeout``), not waited for.
DEFAULT_REQUEST_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Sample:
    """One request: when it was sent (from the start of the point), how long it took, and its outcome."""

    sent_s: float
    latency_s: float
    status: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the request was answered with a 2xx status."""
        return self.error is None


@dataclasses.dataclass
class LoadResult:
    """The requests of one closed-loop point and the wall time they took."""

    concurrency: int
    duration_s: float
    samples: list[Sample]

    @property
    def successes(self) -> int:
        """Requests answered with a 2xx status."""
        return sum(1 for s in self.samples if s.ok)

    @property
    def errors(self) -> int:
        """Requests that failed (status, connection error or timeout)."""
        return len(self.samples) - self.successes

    @property
    def throughput_per_s(self) -> float:
        """Successful requests per second of the point's wall time."""
        return self.successes / self.duration_s if self.duration_s > 0 else 0.0

    def latency_ms(self, quantile: float) -> float | None:
        """The ``quantile`` (0..1) of successful requests' latency in ms (nearest rank), None if none succeeded."""
        latencies = sorted(s.latency_s for s in self.samples if s.ok)
        if not latencies:
            return None
        rank = min(len(latencies) - 1, max(0, math.ceil(quantile * len(latencies)) - 1))
        return latencies[rank] * 1e3

    def error_kinds(self) -> dict[str, int]:
        """How many requests failed, by error text (first 120 characters)."""
        kinds: dict[str, int] = {}
        for s in self.samples:
            if s.error is not None:
                kinds[s.error[:120]] = kinds.get(s.error[:120], 0) + 1
        return kinds

    def summary(self) -> dict[str, Any]:
        """Throughput, latency quantiles and error counts, JSON-ready."""
        mean = (sum(s.latency_s for s in self.samples if s.ok) / self.successes * 1e3) if self.successes else None
        return {"concurrency": self.concurrency, "requests": len(self.samples), "errors": self.errors,
                "duration_s": self.duration_s, "throughput_per_s": self.throughput_per_s,
                "mean_ms": mean, "p50_ms": self.latency_ms(0.50), "p90_ms": self.latency_ms(0.90),
                "p99_ms": self.latency_ms(0.99), "error_kinds": self.error_kinds()}


def kserve_text(text: str) -> dict[str, Any]:
    """The KServe v2 (Triton HTTP) request body of one text as input ``TEXT``, one row."""
    return {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": [text]}]}


def encode_bodies(texts: Sequence[str], payload: Callable[[str], Any]) -> list[bytes]:
    """The JSON request body of each text, encoded once."""
    return [json.dumps(payload(t), ensure_ascii=False).encode("utf-8") for t in texts]


async def _run(url: str, bodies: Sequence[bytes], concurrency: int, duration_s: float | None,
               request_count: int | None, request_timeout_s: float, headers: dict[str, str],
               session: aiohttp.ClientSession) -> LoadResult:
    samples: list[Sample] = []
    next_index = 0
    loop_start = time.perf_counter()
    deadline = loop_start + duration_s if duration_s is not None else None

    def take() -> int | None:
        # Workers draw the bodies in turn, cycling, so every system sees the same text order.
        nonlocal next_index
        if request_count is not None and next_index >= request_count:
            return None
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        index = next_index
        next_index += 1
        return index

    async def worker() -> None:
        while (index := take()) is not None:
            body = bodies[index % len(bodies)]
            sent = time.perf_counter()
            status, error = 0, None
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    status = response.status
                    payload = await response.read()  # the whole answer: the server's serialisation is part of it
                    if not 200 <= status < 300:
                        error = f"HTTP {status}: {payload[:200].decode('utf-8', 'replace')}"
            except asyncio.TimeoutError:
                error = f"timeout after {request_timeout_s} s"
            except aiohttp.ClientError as exc:
                error = f"{type(exc).__name__}: {exc}"
            samples.append(Sample(sent_s=sent - loop_start, latency_s=time.perf_counter() - sent, status=status,
                                  error=error))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    # The point ends when its last answer came: requests sent before the deadline are waited for, so
    # a slow system is not credited with the requests it still held.
    return LoadResult(concurrency=concurrency, duration_s=time.perf_counter() - loop_start, samples=samples)


async def closed_loop_async(url: str, bodies: Sequence[bytes], concurrency: int, *, duration_s: float | None = None,
                            request_count: int | None = None, warmup_s: float = 0.0,
                            request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                            headers: dict[str, str] | None = None) -> LoadResult:
    """Closed-loop load on ``url``: ``concurrency`` workers POST ``bodies`` in turn until the point ends.

    Args:
        url: Where every request is POSTed.
        bodies: Request bodies (``encode_bodies``), used in order and cycled.
        concurrency: Workers, each with one request in flight at a time.
        duration_s: Stop sending after this many seconds (with ``request_count``, whichever comes first).
        request_count: Stop after sending this many requests.
        warmup_s: Seconds of the same load first, on the same connections, not recorded.
        request_timeout_s: A request still unanswered after this long is recorded as an error.
        headers: Extra headers; ``Content-Type: application/json`` is always sent.

    Returns:
        The recorded requests of the measured part.

    Raises:
        ValueError: If neither ``duration_s`` nor ``request_count`` bounds the point, or there are no bodies.
    """
    if duration_s is None and request_count is None:
        raise ValueError("a closed-loop point needs duration_s or request_count")
    if not bodies or concurrency < 1:
        raise ValueError("a closed-loop point needs at least one body and one worker")
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    # One keep-alive connection per worker, as a pool of clients would hold.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if warmup_s > 0:
            await _run(url, bodies, concurrency, warmup_s, None, request_timeout_s, all_headers, session)
        return await _run(url, bodies, concurrency, duration_s, request_count, request_timeout_s, all_headers,
                          session)


def closed_loop(url: str, bodies: Sequence[bytes], concurrency: int, **options: Any) -> LoadResult:
    """``closed_loop_async`` on a fresh event loop (for callers that are not async)."""
    return asyncio.run(closed_loop_async(url, bodies, concurrency, **options))


async def post_json_async(url: str, payload: Any, *, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> Any:
    """POST one JSON body and return the decoded JSON answer.

    Raises:
        RuntimeError: If the answer's status is not 2xx (the message carries the body's start).
    """
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session, \
            session.post(url, json=payload) as response:
        text = await response.text()
        if not 200 <= response.status < 300:
            raise RuntimeError(f"{url}: HTTP {response.status}: {text[:300]}")
        return json.loads(text)


def post_json(url: str, payload: Any, *, timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> Any:
    """``post_json_async`` on a fresh event loop."""
    return asyncio.run(post_json_async(url, payload, timeout_s=timeout_s))
