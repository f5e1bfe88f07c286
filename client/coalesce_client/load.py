"""A short, bounded closed-loop load run: throughput and Triton's batching, measured.

``coalesce-client load`` sends ``requests`` requests from ``concurrency`` threads and
reads Triton's statistics before and after, so the average batch Triton's dynamic
batcher handed the backend (inferences per execution) comes from the server itself.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from coalesce_client.client import EmbeddingClient, TlsOptions

_WORDS = ("batch", "queue", "latency", "token", "model", "server", "request", "vector", "embedding", "search",
          "index", "cache", "throughput", "kernel", "padding", "tensor", "shape", "runtime", "engine", "client",
          "stream", "graph", "layer")


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What one load run measured."""

    requests: int
    texts_per_request: int
    concurrency: int
    protocol: str
    wall_s: float
    inference_count: int
    execution_count: int

    @property
    def requests_per_s(self) -> float:
        """Completed requests per second of wall time."""
        return self.requests / self.wall_s

    @property
    def avg_batch_size(self) -> float:
        """Inferences (rows Triton counted) per backend ``execute``."""
        return self.inference_count / max(self.execution_count, 1)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, derived figures included."""
        return {**dataclasses.asdict(self), "requests_per_s": round(self.requests_per_s, 2),
                "avg_batch_size": round(self.avg_batch_size, 2)}


def sample_texts(count: int, seed: int = 0) -> list[str]:
    """``count`` distinct short texts, reproducible from ``seed``."""
    rng = random.Random(seed)
    return [f"{i} " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 16))) for i in range(count)]


def model_statistics(url: str, model: str, *, tls: TlsOptions | None = None,
                     headers: Mapping[str, str] | None = None) -> dict[str, int]:
    """Triton's cumulative counts for ``model`` over gRPC, summed over its versions.

    Returns ``inference_count`` (rows that succeeded), ``execution_count`` (backend
    ``execute`` calls) and ``failure_count`` (failed inference requests). ``tls`` and
    ``headers`` as for ``EmbeddingClient``.
    """
    import tritonclient.grpc as grpcclient

    from coalesce_client.client import translate_error

    client = grpcclient.InferenceServerClient(url, **(tls.grpc_arguments() if tls else {}))
    try:
        stats = client.get_inference_statistics(model, headers=dict(headers) if headers else None, as_json=True)
    except Exception as exc:
        raise translate_error(exc, model=model, url=url, timeout_s=None) from exc
    finally:
        client.close()
    totals = {"inference_count": 0, "execution_count": 0, "failure_count": 0}
    for entry in stats.get("model_stats", []):
        totals["inference_count"] += int(entry.get("inference_count", 0))
        totals["execution_count"] += int(entry.get("execution_count", 0))
        totals["failure_count"] += int(entry.get("inference_stats", {}).get("fail", {}).get("count", 0))
    return totals


def model_counts(url: str, model: str, *, tls: TlsOptions | None = None,
                 headers: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(inference_count, execution_count)`` of ``model`` from Triton's statistics over gRPC."""
    totals = model_statistics(url, model, tls=tls, headers=headers)
    return totals["inference_count"], totals["execution_count"]


def run_load(client: EmbeddingClient, *, stats_url: str, requests: int = 256, concurrency: int = 32,
             texts_per_request: int = 1, seed: int = 0) -> LoadReport:
    """Send ``requests`` requests of ``texts_per_request`` texts from ``concurrency`` threads.

    Args:
        client: Client to send with (its protocol is the one measured).
        stats_url: gRPC ``host:port`` of the same server, for the statistics.
        requests: Requests to send in all.
        concurrency: Requests in flight at once.
        texts_per_request: Texts in each request.
        seed: Seed of the generated texts.
    """
    texts = sample_texts(requests * texts_per_request, seed)
    batches: Sequence[list[str]] = [texts[i * texts_per_request:(i + 1) * texts_per_request]
                                    for i in range(requests)]
    def counts() -> tuple[int, int]:
        return model_counts(stats_url, client.model, tls=client.tls, headers=client.headers)

    before = counts()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for _ in pool.map(client.embed, batches):
            pass
    wall_s = time.perf_counter() - start
    # Triton records an execution's statistics just after sending its responses: let them land.
    expected = before[0] + requests * texts_per_request
    settle_deadline = time.monotonic() + 5.0
    after = counts()
    while after[0] < expected and time.monotonic() < settle_deadline:
        time.sleep(0.05)
        after = counts()
    return LoadReport(requests=requests, texts_per_request=texts_per_request, concurrency=concurrency,
                      protocol=client.protocol, wall_s=wall_s, inference_count=after[0] - before[0],
                      execution_count=after[1] - before[1])
