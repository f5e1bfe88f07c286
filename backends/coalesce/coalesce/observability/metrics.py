"""Prometheus metrics of the backend: families declared once, with units in names.

The core records through small ``Counter``/``Gauge``/``Histogram`` handles made by
a ``MetricFactory``. The Triton adapter supplies a factory over
``pb_utils.MetricFamily`` (served on Triton's metrics port); tests and code that
runs without Triton use ``InMemoryMetricFactory``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol, TypeVar

#: Seconds per stage: 100 us to 10 s, roughly x2.5 apart.
STAGE_SECONDS_BUCKETS: Final = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                                0.5, 1.0, 2.5, 5.0, 10.0)
#: Rows per forward pass: powers of two up to 1024.
BATCH_ROWS_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: Padded over real tokens of one forward pass (1.0 is no padding).
PADDING_RATIO_BUCKETS: Final = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)

#: Seconds of one shared-cache (Redis) lookup: 100 us to 1 s.
SHARED_LOOKUP_SECONDS_BUCKETS: Final = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
#: What a shared-cache error happened in (label ``op`` of ``coalesce_shared_cache_errors_total``).
SHARED_CACHE_OPS: Final = ("connect", "get", "set", "corrupt")

#: Seconds a request waits in the adaptive scheduler's queue, and end-to-end per tenant: 100 us to 30 s.
WAIT_SECONDS_BUCKETS: Final = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.2, 0.3, 0.5, 1.0, 2.5,
                               5.0, 10.0, 30.0)
#: Reasons a request is answered without being computed (label ``reason``), as in
#: ``coalesce.scheduling.policy.Rejection``.
REJECTION_REASONS: Final = ("deadline", "queue_full", "rate_limit", "expired", "cancelled")

#: Pipeline stages timed by ``coalesce_stage_seconds``: reading requests into rows, preparing the rows to
#: compute (tokenising), planning the passes, running them, the task's own step after each (pooling,
#: activations, cutting rows back) and scattering the rows back to their requests.
STAGES: Final = ("read", "prepare", "plan", "infer", "split", "scatter")


class Counter(Protocol):
    """A monotonically increasing value."""

    def increment(self, value: float) -> None:
        """Add ``value`` (>= 0)."""
        ...


class Gauge(Protocol):
    """A value that goes up and down."""

    def set(self, value: float) -> None:
        """Set the current value."""
        ...


class Histogram(Protocol):
    """A distribution of observed values."""

    def observe(self, value: float) -> None:
        """Record one observation."""
        ...


class MetricFactory(Protocol):
    """Creates metric handles; one family per name, one handle per label set."""

    def counter(self, name: str, description: str, labels: Mapping[str, str]) -> Counter:
        """A counter handle of family ``name`` with the given labels."""
        ...

    def gauge(self, name: str, description: str, labels: Mapping[str, str]) -> Gauge:
        """A gauge handle of family ``name`` with the given labels."""
        ...

    def histogram(self, name: str, description: str, labels: Mapping[str, str],
                  buckets: Sequence[float]) -> Histogram:
        """A histogram handle of family ``name`` with the given labels and buckets."""
        ...


class PipelineMetrics:
    """Every metric the coalescing pipeline records, labelled by model and version, whatever the task."""

    def __init__(self, factory: MetricFactory, *, model: str, version: str) -> None:
        """Create the handles once, at model load."""
        labels = {"model": model, "version": version}
        self.requests = factory.counter("coalesce_requests_total", "Requests received by the backend", labels)
        self.request_failures = factory.counter(
            "coalesce_request_failures_total", "Requests answered with an error", labels)
        self.rows = factory.counter("coalesce_rows_total", "Rows received (texts, pairs or tensor rows)", labels)
        self.executions = factory.counter("coalesce_executions_total", "execute() calls from Triton", labels)
        self.deduplicated_rows = factory.counter(
            "coalesce_deduplicated_rows_total",
            "Rows answered from an identical row of the same execute() instead of being computed again", labels)
        self.forward_passes = factory.counter(
            "coalesce_forward_passes_total", "Forward passes run by the runtime", labels)
        self.wide_passes = factory.counter(
            "coalesce_forward_passes_wide_total",
            "Forward passes run on every core because no other model of the server computed (share_idle_cores)",
            labels)
        self.cache_hits = factory.counter("coalesce_cache_hits_total", "Rows answered from the row cache", labels)
        self.cache_misses = factory.counter(
            "coalesce_cache_misses_total", "Rows looked up in the row cache and not found", labels)
        self.cache_evictions = factory.counter(
            "coalesce_cache_evictions_total", "Rows evicted from the row cache to stay under cache_bytes", labels)
        self.cache_resident_bytes = factory.gauge(
            "coalesce_cache_resident_bytes", "Bytes the row cache holds (the count cache_bytes bounds)", labels)
        self.shared_cache_hits = factory.counter(
            "coalesce_shared_cache_hits_total", "Rows answered from the shared (Redis) tier", labels)
        self.shared_cache_misses = factory.counter(
            "coalesce_shared_cache_misses_total", "Rows looked up in the shared (Redis) tier and not found", labels)
        self.shared_cache_skipped_rows = factory.counter(
            "coalesce_shared_cache_skipped_rows_total",
            "Row lookups and writes skipped while the shared tier stands aside after an error", labels)
        self.shared_cache_dropped_rows = factory.counter(
            "coalesce_shared_cache_dropped_rows_total",
            "Row writes to the shared tier dropped because its write queue was full", labels)
        self.shared_cache_errors = {
            op: factory.counter("coalesce_shared_cache_errors_total",
                                "Shared-tier (Redis) errors; the model served without the tier", {**labels, "op": op})
            for op in SHARED_CACHE_OPS
        }
        self.shared_cache_up = factory.gauge(
            "coalesce_shared_cache_up", "1 while the shared tier answers, 0 while it stands aside after an error",
            labels)
        self.shared_cache_lookup_seconds = factory.histogram(
            "coalesce_shared_cache_lookup_seconds", "Seconds of one batched shared-tier lookup (MGET)", labels,
            SHARED_LOOKUP_SECONDS_BUCKETS)
        self.real_tokens = factory.counter(
            "coalesce_real_tokens_total",
            "Real positions (tokens of text, or a tensor row's length) sent through forward passes", labels)
        self.padded_tokens = factory.counter(
            "coalesce_padded_tokens_total", "Positions computed by forward passes, padding included", labels)
        self.padding_ratio = factory.histogram(
            "coalesce_padding_ratio", "Padded over real positions per forward pass", labels, PADDING_RATIO_BUCKETS)
        self.batch_rows = factory.histogram(
            "coalesce_forward_batch_rows", "Rows per forward pass", labels, BATCH_ROWS_BUCKETS)
        self.stage_seconds = {
            stage: factory.histogram("coalesce_stage_seconds", "Time per pipeline stage per execute()",
                                     {**labels, "stage": stage}, STAGE_SECONDS_BUCKETS)
            for stage in STAGES
        }


@dataclasses.dataclass
class _MemoryCounter:
    value: float = 0.0
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def increment(self, value: float) -> None:
        with self.lock:
            self.value += value


@dataclasses.dataclass
class _MemoryGauge:
    value: float = 0.0

    def set(self, value: float) -> None:
        self.value = value


@dataclasses.dataclass
class _MemoryHistogram:
    buckets: tuple[float, ...]
    observations: list[float] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def observe(self, value: float) -> None:
        with self.lock:
            self.observations.append(value)


class InMemoryMetricFactory:
    """Keeps metric values in memory, for tests and for running the core without Triton."""

    def __init__(self) -> None:
        """Start with no metrics."""
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], _MemoryCounter] = {}
        self.histograms: dict[tuple[str, tuple[tuple[str, str], ...]], _MemoryHistogram] = {}
        self.gauges: dict[tuple[str, tuple[tuple[str, str], ...]], _MemoryGauge] = {}

    def counter(self, name: str, description: str, labels: Mapping[str, str]) -> Counter:
        """A counter kept in memory."""
        return self.counters.setdefault((name, tuple(sorted(labels.items()))), _MemoryCounter())

    def gauge(self, name: str, description: str, labels: Mapping[str, str]) -> Gauge:
        """A gauge kept in memory."""
        return self.gauges.setdefault((name, tuple(sorted(labels.items()))), _MemoryGauge())

    def histogram(self, name: str, description: str, labels: Mapping[str, str],
                  buckets: Sequence[float]) -> Histogram:
        """A histogram kept in memory (all observations)."""
        key = (name, tuple(sorted(labels.items())))
        return self.histograms.setdefault(key, _MemoryHistogram(tuple(buckets)))

    def value(self, name: str, **labels: str) -> float:
        """Sum of counter or gauge ``name`` over label sets that include ``labels``."""
        handles: list[_MemoryCounter | _MemoryGauge] = [
            *(c for (n, ls), c in self.counters.items() if n == name and set(labels.items()) <= set(ls)),
            *(g for (n, ls), g in self.gauges.items() if n == name and set(labels.items()) <= set(ls))]
        return sum(h.value for h in handles)

    def observations(self, name: str, **labels: str) -> list[float]:
        """All observations of histogram ``name`` over label sets that include ``labels``."""
        return [v for (n, ls), h in self.histograms.items()
                if n == name and set(labels.items()) <= set(ls) for v in h.observations]


#: Seconds between two reports of failed metric sends.
ERROR_REPORT_INTERVAL_S: Final = 60.0
#: Observations a buffered histogram keeps between two flushes; later ones are dropped and counted.
MAX_PENDING_OBSERVATIONS: Final = 20_000


class _BufferedCounter:
    def __init__(self, target: Counter) -> None:
        self._target = target
        self._pending = 0.0
        self._lock = threading.Lock()

    def increment(self, value: float) -> None:
        with self._lock:
            self._pending += value

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, 0.0
        if pending:
            self._target.increment(pending)


class _BufferedGauge:
    def __init__(self, target: Gauge) -> None:
        self._target = target
        self._value: float | None = None  # None: unchanged since the last flush

    def set(self, value: float) -> None:
        self._value = value

    def flush(self) -> None:
        value, self._value = self._value, None
        if value is not None:
            self._target.set(value)


class _BufferedHistogram:
    def __init__(self, target: Histogram, dropped: _BufferedCounter) -> None:
        self._target = target
        self._dropped = dropped
        self._pending: list[float] = []
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            if len(self._pending) < MAX_PENDING_OBSERVATIONS:
                self._pending.append(value)
                return
        self._dropped.increment(1)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for value in pending:
            self._target.observe(value)


_HandleT = TypeVar("_HandleT", _BufferedCounter, _BufferedGauge, _BufferedHistogram)


class BufferedMetricFactory:
    """Records metrics in process and sends what changed to another factory from a flusher thread.

    In Triton's Python backend every metric operation is a synchronous round trip to
    the server process (measured on 2.51 here: 25 to 120 us each, more under load),
    and the pipeline and scheduler record some thirty values per request. Sent inline
    they added milliseconds to every answer. Buffered, a counter costs one addition on
    the request path and one round trip per flush whatever the traffic; a gauge sends
    its last value; a histogram sends each observation, off the request path (at most
    ``MAX_PENDING_OBSERVATIONS`` per flush, the rest counted in
    ``coalesce_metric_observations_dropped_total``). Scrapes lag by up to one interval.
    """

    def __init__(self, target: MetricFactory, *, interval_s: float,
                 on_error: Callable[[Exception], None] | None = None) -> None:
        """Wrap ``target``; with ``interval_s`` > 0 a daemon thread flushes that often (else call ``flush``).

        ``on_error`` hears of a failed send at most once per ``ERROR_REPORT_INTERVAL_S``.
        """
        self._target = target
        self._handles: list[_BufferedCounter | _BufferedGauge | _BufferedHistogram] = []
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._on_error = on_error
        self._last_error_report_s = -math.inf
        self._stop = threading.Event()
        self._dropped = self._register(_BufferedCounter(target.counter(
            "coalesce_metric_observations_dropped_total",
            "Histogram observations dropped because more arrived between two metric flushes than are kept", {})))
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._run, args=(interval_s,), name="coalesce-metrics",
                                            daemon=True)
            self._thread.start()

    def _register(self, handle: _HandleT) -> _HandleT:
        with self._lock:
            self._handles.append(handle)
        return handle

    def counter(self, name: str, description: str, labels: Mapping[str, str]) -> Counter:
        """A counter whose increments are summed until the next flush."""
        return self._register(_BufferedCounter(self._target.counter(name, description, labels)))

    def gauge(self, name: str, description: str, labels: Mapping[str, str]) -> Gauge:
        """A gauge whose last value is sent at the next flush."""
        return self._register(_BufferedGauge(self._target.gauge(name, description, labels)))

    def histogram(self, name: str, description: str, labels: Mapping[str, str],
                  buckets: Sequence[float]) -> Histogram:
        """A histogram whose observations are sent at the next flush."""
        return self._register(_BufferedHistogram(self._target.histogram(name, description, labels, buckets),
                                                 self._dropped))

    def flush(self) -> None:
        """Send everything recorded since the last flush (thread-safe; one flush at a time)."""
        with self._flush_lock:
            with self._lock:
                handles = list(self._handles)
            for handle in handles:
                try:
                    handle.flush()
                except Exception as exc:  # a metric that cannot be sent must not stop the others
                    now = time.monotonic()
                    if self._on_error is not None and now - self._last_error_report_s >= ERROR_REPORT_INTERVAL_S:
                        self._last_error_report_s = now
                        self._on_error(exc)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.flush()

    def close(self, *, flush: bool = True) -> None:
        """Stop the flusher thread, then (with ``flush``) send what is left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if flush:
            self.flush()


class SchedulerMetrics:
    """Metrics of the adaptive scheduler, labelled by model and version (and tenant where it says)."""

    def __init__(self, factory: MetricFactory, *, model: str, version: str) -> None:
        """Create the fixed handles once, at model load; per-tenant handles are made on first use."""
        self._factory = factory
        self._labels = labels = {"model": model, "version": version}
        self.queue_requests = factory.gauge("coalesce_queue_requests", "Requests in the scheduler's queue", labels)
        self.queue_rows = factory.gauge("coalesce_queue_rows", "Rows in the scheduler's queue", labels)
        self.wait_seconds = factory.histogram(
            "coalesce_queue_wait_seconds", "Seconds from arrival to dispatch per request", labels,
            WAIT_SECONDS_BUCKETS)
        self.dispatch_rows = factory.histogram(
            "coalesce_dispatch_rows", "Rows per dispatch the scheduler chose", labels, BATCH_ROWS_BUCKETS)
        self.predicted_seconds = factory.histogram(
            "coalesce_dispatch_predicted_seconds", "Predicted run time per dispatch (cost model)", labels,
            STAGE_SECONDS_BUCKETS)
        self.actual_seconds = factory.histogram(
            "coalesce_dispatch_seconds", "Actual run time per dispatch", labels, STAGE_SECONDS_BUCKETS)
        self.cost_model_error = factory.gauge(
            "coalesce_cost_model_error_ratio",
            "Moving average of |actual - predicted| / actual run time per dispatch (learning cost model)", labels)
        self.cost_model_tail_ratio = factory.gauge(
            "coalesce_cost_model_tail_ratio",
            "90th percentile of recent actual over predicted dispatch times (deadlines are planned with it)", labels)
        self.send_seconds = factory.gauge(
            "coalesce_answer_send_seconds",
            "Moving average of seconds from a dispatch's end to its last answer sent (taken off request budgets)",
            labels)
        self.cost_model_scale = factory.gauge(
            "coalesce_cost_model_scale", "Learned correction of predicted run times (actual over predicted)", labels)
        self.cost_model_overhead_seconds = factory.gauge(
            "coalesce_cost_model_overhead_seconds",
            "Learned seconds every dispatch costs beyond its forward passes (predicted = overhead + scale * passes)",
            labels)
        self.scheduler_restarts = factory.counter(
            "coalesce_scheduler_restarts_total",
            "Times the scheduler thread failed, answered what it held with INTERNAL and started again", labels)
        self.rejections = {
            reason: factory.counter("coalesce_rejections_total", "Requests answered without being computed",
                                    {**labels, "reason": reason})
            for reason in REJECTION_REASONS
        }
        self._tenant: dict[tuple[str, str, str], Counter | Histogram] = {}
        self._lock = threading.Lock()

    def _per_tenant(self, kind: str, tenant: str, reason: str = "") -> Counter | Histogram:
        with self._lock:
            handle = self._tenant.get((kind, tenant, reason))
            if handle is None:
                labels = {**self._labels, "tenant": tenant}
                if kind == "rejections":
                    handle = self._factory.counter(
                        "coalesce_tenant_rejections_total", "Requests answered without being computed, per tenant",
                        {**labels, "reason": reason})
                elif kind == "rows":
                    handle = self._factory.counter("coalesce_tenant_rows_total", "Rows answered per tenant", labels)
                elif kind == "failures":
                    handle = self._factory.counter(
                        "coalesce_tenant_failures_total", "Accepted requests answered with an error, per tenant",
                        labels)
                else:
                    handle = self._factory.histogram(
                        "coalesce_tenant_latency_seconds", "Seconds from arrival to answer per request, per tenant",
                        labels, WAIT_SECONDS_BUCKETS)
                self._tenant[(kind, tenant, reason)] = handle
            return handle

    def tenant_rejections(self, tenant: str, reason: str) -> Counter:
        """Requests of ``tenant`` refused for ``reason`` (one of ``REJECTION_REASONS``)."""
        return self._per_tenant("rejections", tenant, reason)  # type: ignore[return-value]

    def tenant_rows(self, tenant: str) -> Counter:
        """Rows answered for ``tenant``."""
        return self._per_tenant("rows", tenant)  # type: ignore[return-value]

    def tenant_failures(self, tenant: str) -> Counter:
        """Accepted requests of ``tenant`` answered with an error."""
        return self._per_tenant("failures", tenant)  # type: ignore[return-value]

    def tenant_latency(self, tenant: str) -> Histogram:
        """End-to-end latency in the backend of ``tenant``'s requests."""
        return self._per_tenant("latency", tenant)  # type: ignore[return-value]


#: Seconds to a request's first token, and between two of its tokens: 1 ms to 60 s.
TOKEN_SECONDS_BUCKETS: Final = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                                60.0)
#: Why a generation request was refused (label ``reason``): too many waiting, or no room in the KV cache in time.
GENERATION_REFUSALS: Final = ("queue_full", "kv_full")
#: How a sequence ended (label ``reason``), vLLM's names.
FINISH_REASONS: Final = ("stop", "length")
#: States of KV-cache blocks (label ``state``): held by sequences, cached prefixes held by none, free.
KV_BLOCK_STATES: Final = ("used", "cached", "free")


class GenerationMetrics:
    """Every metric of the generate task, labelled by model and version."""

    def __init__(self, factory: MetricFactory, *, model: str, version: str) -> None:
        """Create the handles once, at model load."""
        labels = {"model": model, "version": version}
        self.time_to_first_token_seconds = factory.histogram(
            "coalesce_generate_time_to_first_token_seconds",
            "Seconds from a request reaching the backend to its first generated token", labels, TOKEN_SECONDS_BUCKETS)
        self.inter_token_seconds = factory.histogram(
            "coalesce_generate_inter_token_seconds", "Seconds between two generated tokens of one request", labels,
            TOKEN_SECONDS_BUCKETS)
        self.queue_seconds = factory.histogram(
            "coalesce_generate_queue_seconds", "Seconds a request waited to join the running batch", labels,
            WAIT_SECONDS_BUCKETS)
        self.generated_tokens = factory.counter("coalesce_generate_tokens_total", "Tokens generated", labels)
        self.prompt_tokens = factory.counter(
            "coalesce_generate_prompt_tokens_total", "Prompt tokens of the requests that joined", labels)
        self.prefix_hit_tokens = factory.counter(
            "coalesce_generate_prefix_cache_hit_tokens_total",
            "Prompt tokens whose keys and values came from the prefix cache instead of being computed", labels)
        self.active_sequences = factory.gauge(
            "coalesce_generate_active_sequences", "Sequences in the running batch", labels)
        self.waiting_sequences = factory.gauge(
            "coalesce_generate_waiting_sequences", "Requests waiting to join the running batch", labels)
        self.kv_blocks_total = factory.gauge(
            "coalesce_generate_kv_cache_blocks_total", "Blocks of the KV-cache pool (kv_cache_bytes)", labels)
        self.kv_blocks = {state: factory.gauge(
            "coalesce_generate_kv_cache_blocks", "KV-cache blocks by state: used by sequences, cached prefixes "
            "held by none, free", {**labels, "state": state}) for state in KV_BLOCK_STATES}
        self.refusals = {reason: factory.counter(
            "coalesce_generate_refusals_total", "Requests refused with UNAVAILABLE: too many waiting, or no room "
            "in the KV cache within max_queue_wait_ms", {**labels, "reason": reason}) for reason in GENERATION_REFUSALS}
        self.finished = {reason: factory.counter(
            "coalesce_generate_finished_total", "Requests that ended normally, by reason: stop (end of sequence or "
            "a stop string) or length (max_tokens or the context)", {**labels, "reason": reason})
            for reason in FINISH_REASONS}
        self.cancelled = factory.counter(
            "coalesce_generate_cancelled_total", "Requests cancelled by their client", labels)
        self.failures = factory.counter(
            "coalesce_generate_failures_total", "Requests answered with an error after they queued", labels)
        self.step_failures = factory.counter(
            "coalesce_generate_step_failures_total", "Steps whose forward pass failed (their sequences got INTERNAL)",
            labels)
