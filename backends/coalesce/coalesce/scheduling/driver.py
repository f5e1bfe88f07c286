"""The adaptive scheduler's thread: requests in from ``execute``, answers out through their responders.

``execute`` hands each request over as a ``Submission`` and returns at once; this
module admits it under the policy of ``coalesce.scheduling.policy`` (answering a
refusal at once), and one scheduler thread runs the dispatches the policy chooses
through the model's pipeline, answering every request through its own ``respond``
callable (in a server, the request's response sender). Every accepted request gets
exactly one answer: its outputs, or an error with a Triton code. Runs without Triton,
for every task.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Final

import numpy as np

from coalesce.batching.pipeline import Pipeline, RequestResult
from coalesce.core.errors import CancelledError, CoalesceError, InvalidInputError, UnavailableError
from coalesce.core.protocol import PRIORITY_PARAMETER, REFUSED_PREFIX, TENANT_PARAMETER
from coalesce.core.task import Row
from coalesce.observability.log import Logger
from coalesce.observability.metrics import SchedulerMetrics
from coalesce.scheduling.policy import (
    DEFAULT_PRIORITY,
    DEFAULT_TENANT,
    AdaptiveQueue,
    CostEstimator,
    Dispatch,
    Job,
    Rejection,
    SchedulerConfig,
)
from coalesce.settings import ModelSettings

#: Weight of the moving average of answer-send latency (per dispatch).
SEND_EWMA_WEIGHT: Final = 0.2
#: Threads that send answers through response senders.
ANSWER_THREADS: Final = 4
#: Distinct tenant label values kept in metrics; later tenants are counted as "other".
MAX_TENANT_LABELS: Final = 32


@dataclasses.dataclass
class Submission:
    """One request as ``execute`` hands it over.

    Attributes:
        tensors: Its input tensors by name, or the error found while reading them.
        respond: Sends its one answer (outputs or error); called exactly once.
        tenant: Fair-queuing class (request parameter ``tenant``).
        priority: Triton priority level (0: the model's default).
        timeout_s: The request's own timeout (0: none).
        is_cancelled: Whether the client has cancelled it.
        size_bytes: Its size (``coalesce.core.limits.request_bytes``) where the caller already
            measured it against ``max_request_bytes``; None: the pipeline measures it.
    """

    tensors: Mapping[str, np.ndarray] | CoalesceError
    respond: Callable[[RequestResult], None]
    tenant: str = DEFAULT_TENANT
    priority: int = DEFAULT_PRIORITY
    timeout_s: float = 0.0
    is_cancelled: Callable[[], bool] | None = None
    size_bytes: int | None = None


#: Hands one answer to its request: sent through the sender threads (the Future) or kept to return from execute.
Deliver = Callable[[Submission, RequestResult], "Future[None] | None"]

#: Longest tenant name accepted.
MAX_TENANT_CHARS: Final = 128
#: How the detail of a refusal for the queue's bytes begins (after ``REFUSED_PREFIX``).
QUEUE_BYTES_DETAIL: Final = "queue holds "


def triton_queue_timeout_s(model_config: Mapping[str, Any]) -> float:
    """How long a request may wait in Triton's own queue before Triton refuses it (0: no such policy).

    Read from ``dynamic_batching.default_queue_policy`` when its ``timeout_action`` is
    ``REJECT``: the backend cannot see that wait, so its deadlines must leave room for it.
    """
    policy = (model_config.get("dynamic_batching") or {}).get("default_queue_policy") or {}
    if str(policy.get("timeout_action", "REJECT")).upper() != "REJECT":
        return 0.0
    return int(policy.get("default_timeout_microseconds", 0) or 0) / 1e6


def scheduler_config(settings: ModelSettings, *, triton_queue_timeout_s: float = 0.0) -> SchedulerConfig:
    """The policy's configuration from the model's settings.

    The backend's share of ``target_p99_ms`` is what Triton's queue policy leaves of it
    (never under a tenth of the target).

    With such a policy no dispatch runs inline in ``execute``: on Triton 2.51, with a
    ``default_queue_policy`` timeout, about one request in a hundred that arrived while
    an inline run held ``execute`` sat 500 ms in Triton's queue (its batcher's idle wait)
    and was then refused as timed out (measured at concurrency 1; none without the
    policy). ``execute`` that only queues returns within a millisecond and avoids it.
    """
    options = settings.scheduler
    target_s = options.target_p99_ms / 1000
    return SchedulerConfig(
        target_s=max(target_s - triton_queue_timeout_s, 0.1 * target_s), max_queue_rows=options.max_queue_rows,
        max_queue_bytes=options.max_queue_bytes,
        max_dispatch_rows=options.max_dispatch_rows, max_batch_rows=settings.planner.max_batch_rows,
        tenant_weights=options.weights, tenant_max_rows_per_s=options.rate_limits,
        default_priority=options.default_priority,
        inline_share=0.0 if triton_queue_timeout_s > 0 else SchedulerConfig.inline_share)


def read_parameters(parameters_json: str) -> tuple[str, int] | InvalidInputError:
    """``(tenant, priority)`` from a request's parameters (JSON, as Triton hands them over), or the error.

    Triton 2.51's Python backend does not expose a request's priority to the model
    (``InferenceRequest`` has no ``priority()``), and Triton reserves the ``priority``
    parameter name for its own use, so the adaptive scheduler reads a
    ``priority_level`` request parameter (1 is the highest, as in Triton; 0 or absent:
    the model's ``default_priority``).
    """
    try:
        parameters = json.loads(parameters_json) if parameters_json else {}
    except ValueError:
        return InvalidInputError(f"request parameters are not valid JSON: {parameters_json[:100]!r}")
    if not isinstance(parameters, dict):
        return InvalidInputError("request parameters must be a JSON object")
    tenant = parameters.get(TENANT_PARAMETER, DEFAULT_TENANT)
    if not isinstance(tenant, str) or not tenant or len(tenant) > MAX_TENANT_CHARS:
        return InvalidInputError(f"request parameter '{TENANT_PARAMETER}' must be a non-empty string of at most "
                                 f"{MAX_TENANT_CHARS} characters, got {tenant!r}")
    priority = parameters.get(PRIORITY_PARAMETER, DEFAULT_PRIORITY)
    if isinstance(priority, str) and priority.strip().isdigit():
        priority = int(priority)
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        return InvalidInputError(f"request parameter '{PRIORITY_PARAMETER}' must be an integer >= 0 "
                                 f"(1 is the highest level), got {priority!r}")
    return tenant, priority


def rejection_error(reason: Rejection, job: Job, now: float, detail: str = "") -> CoalesceError:
    """The error a refused job is answered with, saying why.

    Refusals under load start with ``REFUSED_PREFIX`` so that clients can tell them
    from an unreachable server and retry (``coalesce_client.RequestRejectedError``).
    """
    if reason is Rejection.CANCELLED:
        return CancelledError("request was cancelled before it was computed")
    budget_ms = (job.deadline_s - job.arrival_s) * 1000
    if reason is Rejection.DEADLINE:
        why = f"it cannot meet its deadline of {budget_ms:.0f} ms: {detail}; retry later or with a longer timeout"
    elif reason is Rejection.EXPIRED:
        why = (f"it can no longer meet its deadline of {budget_ms:.0f} ms after "
               f"{(now - job.arrival_s) * 1000:.0f} ms in the queue")
    elif reason is Rejection.QUEUE_FULL and detail.startswith(QUEUE_BYTES_DETAIL):
        why = f"{detail}; retry later"
    elif reason is Rejection.QUEUE_FULL:
        why = f"the queue is full ({detail}); retry later"
    else:
        why = f"tenant '{job.tenant}' is over its rate limit ({detail}); retry later"
    return UnavailableError(REFUSED_PREFIX + why)


class AdaptiveScheduler:
    """Owns the backend's queue and the thread that dispatches from it; thread-safe ``submit``."""

    def __init__(self, pipeline: Pipeline, config: SchedulerConfig, metrics: SchedulerMetrics,
                 logger: Logger | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        """Start the scheduler thread over ``pipeline``."""
        self.pipeline = pipeline
        self.config = config
        self.metrics = metrics
        self.logger = logger or Logger(pipeline.model_name)
        self._clock = clock
        self.cost = CostEstimator(pipeline.cost_model, pipeline.cost_samples)
        pipeline.pass_observers.append(self._observe_pass)
        self.queue = AdaptiveQueue(config, self.cost)
        self._cond = threading.Condition()
        self._busy_until_s = 0.0
        self._send_latency_s = 0.0  # moving average, dispatch end to its last answer sent
        self._running = False  # a dispatch is running (in the scheduler thread or inline in execute)
        self._closing = False
        self._tenant_labels: set[str] = set()
        # A response sender's send waits on a round trip to the server process; sending from a few
        # threads overlaps those waits, and the scheduler thread goes on to the next dispatch meanwhile.
        self._senders = concurrent.futures.ThreadPoolExecutor(max_workers=ANSWER_THREADS,
                                                              thread_name_prefix="coalesce-answer")
        #: Jobs of the dispatch the scheduler thread is running, and the requests of it already answered.
        self._taken: list[Job] = []
        self._answered: set[int] = set()
        self.restarts = 0
        self._thread = threading.Thread(target=self._supervise, name="coalesce-scheduler", daemon=True)
        self._thread.start()

    # -- from execute ---------------------------------------------------------------------------------

    def submit(self, submissions: Sequence[Submission]) -> list[RequestResult | None]:
        """Queue the requests of one ``execute``; return the answers that are ready now, in order.

        An entry is the answer to give the request from ``execute`` itself (bad input, a
        refusal, or outputs computed inline), or None: its ``respond`` will be called
        later. Answers returned from ``execute`` travel back with its reply, which in
        Triton's Python backend is much cheaper than a response sender's round trip.

        Inline runs: when the executor is idle and the policy would dispatch at once a
        pass predicted to take at most ``SchedulerConfig.inline_share`` of the target, the
        calling thread runs it (a quiet server answers without any thread hand-off).
        Requests that arrive meanwhile wait in Triton's queue for at most that long.
        """
        now = self._clock()
        answers: list[RequestResult | None] = [None] * len(submissions)
        read: list[tuple[int, Submission, list[Row]]] = []
        sizes: dict[int, int] = {}
        start = time.perf_counter()
        for index, sub in enumerate(submissions):
            rows, sizes[id(sub)] = self.pipeline.read_sized(sub.tensors, size_bytes=sub.size_bytes)
            sub.tensors = {}  # read once; a queued request keeps only its rows (texts already cut)
            if isinstance(rows, CoalesceError):
                answers[index] = rows
            else:
                read.append((index, sub, rows))
        self.pipeline.metrics.stage_seconds["read"].observe(time.perf_counter() - start)
        # One batched call for every row of this execute (a tokenizer runs it in parallel).
        lengths = self.pipeline.lengths([row for *_, rows in read for row in rows])
        ends = np.cumsum([len(rows) for *_, rows in read], dtype=np.int64)
        prepared: list[tuple[int, Submission, list[Row], int, int]] = []
        for (index, sub, rows), end in zip(read, ends, strict=True):
            mine = lengths[end - len(rows):end]
            prepared.append((index, sub, rows, int(mine.sum()), int(mine.max())))
        inline: Dispatch | None = None
        dropped: list[tuple[Job, Rejection]] = []
        with self._cond:
            if self._closing:
                for index, *_ in prepared:
                    answers[index] = UnavailableError("model is unloading")
                prepared = []
            for index, sub, rows, tokens, longest in prepared:
                job = self._job(sub, rows, tokens, longest, now)
                job.size_bytes = sizes[id(sub)]
                reason = self.queue.admit(job, now, self._busy_until_s)
                if reason is None:
                    continue
                answers[index] = rejection_error(reason, job, now, self._detail(reason, job, now))
                self._count_rejection(job, reason)
            if prepared and self.config.inline_share > 0 and not self._running and len(self.queue):
                dropped = self.queue.purge(now)
                inline = self.queue.decide_within(now, self.config.inline_share * self.config.target_s)
                if inline is not None:
                    self._start_running(inline, now)
            self._set_depth()
            if inline is None:
                self._cond.notify_all()
        own = {id(prepared_sub): index for index, prepared_sub, *_ in prepared}

        def deliver(sub: Submission, result: RequestResult) -> Future[None] | None:
            at = own.get(id(sub))
            if at is None:
                return self._answer(sub, result)
            answers[at] = result
            return None

        self._reject(dropped, now, deliver)
        if inline is not None:
            answered: set[int] = set()

            def deliver_once(sub: Submission, result: RequestResult) -> Future[None] | None:
                answered.add(id(sub))
                return deliver(sub, result)

            try:
                self._run(inline, now, deliver_once)
            except Exception as exc:  # every request still gets an answer; execute goes on
                self._fail([j for j in [*inline.expired, *inline.jobs] if id(j.payload[0]) not in answered],
                           exc, deliver, where="an inline dispatch")
            finally:
                self._finish_running()
        return answers

    def _job(self, sub: Submission, rows: list[Row], tokens: int, longest: int, now: float) -> Job:
        # Under self._cond. The answer must be out by the deadline: the time sending takes
        # (learned; at most half the budget) comes off it.
        target = self.config.target_s
        budget = min(target, sub.timeout_s) if sub.timeout_s > 0 else target
        budget -= min(self._send_latency_s, budget / 2)
        priority = sub.priority if sub.priority > 0 else self.config.default_priority
        return Job(seq=self.queue.next_seq(), arrival_s=now, deadline_s=now + budget, rows=len(rows),
                   tokens=tokens, max_length=longest, tenant=sub.tenant or DEFAULT_TENANT, priority=priority,
                   payload=(sub, rows), is_cancelled=sub.is_cancelled)

    def _detail(self, reason: Rejection, job: Job, now: float) -> str:
        if reason is Rejection.DEADLINE:
            finish = self.queue.last_finish_s
            return (f"{len(self.queue)} request(s) with {self.queue.rows} row(s) queued, predicted answer in "
                    f"{(finish - now) * 1000:.0f} ms")
        if reason is Rejection.QUEUE_FULL and self.queue.over_bytes(job):
            return (f"{QUEUE_BYTES_DETAIL}{self.queue.size_bytes} bytes, and this request's {job.size_bytes} would "
                    f"pass the limit of {self.config.max_queue_bytes} (parameter 'max_queue_bytes')")
        if reason is Rejection.QUEUE_FULL:
            return f"{self.queue.rows} rows queued, limit {self.config.max_queue_rows} (parameter 'max_queue_rows')"
        if reason is Rejection.RATE_LIMIT:
            return f"{self.config.tenant_max_rows_per_s[job.tenant]:g} rows/s"
        return ""

    # -- the scheduler thread -------------------------------------------------------------------------

    def _supervise(self) -> None:
        """Run ``_loop`` until the scheduler closes; after any failure, answer what it held and start it again.

        A failure outside the pipeline (the policy, a metric, a response sender, a
        cancellation check) would otherwise end the thread, and every request queued or
        taken would wait forever for an answer.
        """
        while True:
            try:
                self._loop()
                return
            except Exception as exc:
                with self._cond:
                    held = [j for j in self._taken if id(j.payload[0]) not in self._answered]
                    held += self.queue.take_all()
                    self._taken, self._answered = [], set()
                    self._running = False
                    self._busy_until_s = 0.0
                    self.restarts += 1
                    restarts = self.restarts
                    self._cond.notify_all()
                try:
                    self.metrics.scheduler_restarts.increment(1)
                    self._set_depth()
                except Exception as metric_exc:
                    self.logger.error(f"scheduler metrics failed after a restart: {metric_exc!r}")
                self._fail(held, exc, self._answer, where=f"the scheduler thread (restart {restarts})")

    def _fail(self, jobs: Sequence[Job], exc: Exception, deliver: Deliver, *, where: str) -> None:
        """Answer ``jobs`` with INTERNAL after ``exc`` broke ``where``; log it once."""
        self.logger.error(f"{where} failed: {exc!r}; answering {len(jobs)} request(s) it held with INTERNAL")
        for job in jobs:
            try:
                deliver(job.payload[0], CoalesceError(f"internal error: the backend's scheduler failed while "
                                                      f"this request was queued ({type(exc).__name__}: {exc}); "
                                                      "later requests are served, retry"))
            except Exception as send_exc:  # one broken sender must not leave the others unanswered
                self.logger.error(f"answering after a scheduler failure failed: {send_exc!r}")

    def _deliver_taken(self, sub: Submission, result: RequestResult) -> Future[None] | None:
        """``_answer`` for the scheduler thread's dispatches, noting who is answered (for ``_supervise``)."""
        self._answered.add(id(sub))
        return self._answer(sub, result)

    def _loop(self) -> None:
        while True:
            with self._cond:
                dispatch = None
                while dispatch is None:
                    if self._closing and not len(self.queue) and not self._running:
                        return
                    if self._running:  # an inline run in execute's thread
                        self._cond.wait()
                        continue
                    now = self._clock()
                    dropped = self.queue.purge(now)
                    if dropped:
                        break
                    decision = self.queue.decide(now) if not self._closing else self._drain(now)
                    if isinstance(decision, Dispatch):
                        dispatch = decision
                        self._taken, self._answered = [*decision.expired, *decision.jobs], set()
                        self._start_running(decision, now)
                    else:
                        self._cond.wait(None if math.isinf(decision.until_s) else max(0.0, decision.until_s - now))
                self._set_depth()
            if dispatch is None:
                self._reject(dropped, now, self._answer)
                continue
            try:
                self._run(dispatch, now, self._deliver_taken)
            finally:
                self._finish_running()
            self._taken = []

    def _start_running(self, dispatch: Dispatch, now: float) -> None:
        # Under self._cond: the executor is taken until _finish_running.
        self._running = True
        self._busy_until_s = now + dispatch.predicted_s * self.queue.margin

    def _finish_running(self) -> None:
        with self._cond:
            self._running = False
            self._busy_until_s = 0.0
            self._cond.notify_all()

    def _track_sends(self, futures: list[Future[None]], since: float) -> None:
        """Learn how long a dispatch's answers take to go out, from ``since`` to the last one sent.

        Sends run beside the next dispatch (they wait on the server, not on the CPU), so
        they do not occupy the executor; their latency is taken off every new request's
        budget instead (``_job``).
        """
        if not futures:
            return
        left = [len(futures)]
        lock = threading.Lock()

        def one_sent(_: Future[None]) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            latency = time.perf_counter() - since
            with self._cond:
                self._send_latency_s = (latency if self._send_latency_s == 0 else
                                        (1 - SEND_EWMA_WEIGHT) * self._send_latency_s + SEND_EWMA_WEIGHT * latency)
            self.metrics.send_seconds.set(self._send_latency_s)

        for future in futures:
            future.add_done_callback(one_sent)

    def _reject(self, dropped: list[tuple[Job, Rejection]], now: float, deliver: Deliver) -> None:
        for job, reason in dropped:
            self._count_rejection(job, reason)
            deliver(job.payload[0], rejection_error(reason, job, now))

    def _drain(self, now: float) -> Dispatch:
        # Unloading: whatever is queued runs now, without waiting for more.
        decision = self.queue.decide(math.inf)
        assert isinstance(decision, Dispatch)
        return decision

    def _run(self, dispatch: Dispatch, started: float, deliver: Deliver) -> None:
        """Run ``dispatch`` and hand every answer to ``deliver``.

        The run time the cost model learns from ends with the computation: answers go out
        beside the next dispatch, and their latency is learned apart (``_track_sends``).
        """
        metrics = self.metrics
        for job in dispatch.expired:
            self._count_rejection(job, Rejection.EXPIRED)
            deliver(job.payload[0], rejection_error(Rejection.EXPIRED, job, started))
        # Asked here rather than on every wake-up, and only of jobs that waited a while: each
        # question is a round trip to the server. A watcher thread asking queued jobs beside the
        # dispatch was tried (these round trips took ~7% of the executor's time at 1.5x capacity):
        # a question about a request answered meanwhile touches what the server freed (it crashed
        # the server), and once made safe, queries at 2x capacity kept 38 answers/s in time
        # against ~100/s without it (one evaluation run; likely the extra questions, every queued
        # job asked again as it waited, delaying the answers on the same channel to the server).
        jobs = []
        for job in dispatch.jobs:
            check = job.is_cancelled
            if (check is not None and self.config.asks_if_cancelled(started - job.arrival_s,
                                                                    job.deadline_s - job.arrival_s) and check()):
                self._count_rejection(job, Rejection.CANCELLED)
                deliver(job.payload[0], rejection_error(Rejection.CANCELLED, job, started))
            else:
                jobs.append(job)
        if not jobs:
            return
        rows = sum(j.rows for j in jobs)
        metrics.dispatch_rows.observe(rows)
        metrics.predicted_seconds.observe(dispatch.predicted_s)
        for job in jobs:
            metrics.wait_seconds.observe(started - job.arrival_s)
        t0 = time.perf_counter()
        try:
            results = self.pipeline.run([job.payload[1] for job in jobs])
        except Exception as exc:  # every request still gets an answer
            self.logger.error(f"dispatch of {len(jobs)} request(s) failed: {exc!r}")
            results = [CoalesceError(f"internal error: {exc}") for _ in jobs]
        computed = time.perf_counter()
        actual = computed - t0
        tenants = [self._tenant_label(job.tenant) for job in jobs]
        sends = []
        for job, tenant, result in zip(jobs, tenants, results, strict=True):
            if isinstance(result, CoalesceError):
                metrics.tenant_failures(tenant).increment(1)
            else:
                metrics.tenant_rows(tenant).increment(job.rows)
            sends.append(deliver(job.payload[0], result))
        done = self._clock()
        for job, tenant in zip(jobs, tenants, strict=True):
            metrics.tenant_latency(tenant).observe(done - job.arrival_s)
        self._track_sends([f for f in sends if f is not None], computed)
        with self._cond:  # the policy reads the estimator under this lock
            self.cost.observe_dispatch(dispatch.raw_s, dispatch.predicted_s, actual)
            self.queue.cost_changed()
        metrics.actual_seconds.observe(actual)
        metrics.cost_model_error.set(self.cost.error)
        metrics.cost_model_scale.set(self.cost.scale)
        metrics.cost_model_overhead_seconds.set(self.cost.overhead_s)
        metrics.cost_model_tail_ratio.set(self.cost.tail_ratio)

    def _observe_pass(self, rows: int, length: int, seconds: float) -> None:
        with self._cond:
            self.cost.observe(rows, length, seconds)

    # -- helpers --------------------------------------------------------------------------------------

    def _answer(self, sub: Submission, result: RequestResult) -> Future[None] | None:
        """Send ``sub``'s answer from a sender thread (the ``Deliver`` of answers not returned from execute)."""
        try:
            return self._senders.submit(self._send, sub.respond, result)
        except RuntimeError:  # the sender threads are gone (after close): answer from this thread
            self._send(sub.respond, result)
            return None

    def _send(self, respond: Callable[[RequestResult], None], result: RequestResult) -> None:
        try:
            respond(result)
        except Exception as exc:  # one broken stream must not stop the others
            self.logger.error(f"sending a response failed: {exc!r}")

    def _count_rejection(self, job: Job, reason: Rejection) -> None:
        self.metrics.rejections[reason.value].increment(1)
        self.metrics.tenant_rejections(self._tenant_label(job.tenant), reason.value).increment(1)

    def _tenant_label(self, tenant: str) -> str:
        if tenant in self._tenant_labels:
            return tenant
        if len(self._tenant_labels) < MAX_TENANT_LABELS:
            self._tenant_labels.add(tenant)
            return tenant
        return "other"

    def _set_depth(self) -> None:
        self.metrics.queue_requests.set(len(self.queue))
        self.metrics.queue_rows.set(self.queue.rows)

    def close(self, timeout_s: float = 30.0) -> None:
        """Answer what is queued (computed, not dropped), then stop the threads once every answer is sent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._senders.shutdown(wait=True)

