"""The adaptive scheduling policy: pure functions of the queue, the cost model and ``now``.

With ``scheduling: adaptive`` Triton's own queue delay is 0 and every request lands in
the backend's queue at once; this module decides what to do with it. Nothing here
reads a clock, starts a thread or knows Triton: every method takes ``now`` (seconds on
a monotonic clock), so the policy is tested deterministically on a simulated clock and
driven by ``coalesce.scheduling.driver`` in a server. It sees rows, positions and
lengths only, never what a row holds: it serves every task alike.

The policy, in short:

- **Order.** Triton priority level first (1 is the highest; lower numbers go first),
  then weighted fair queuing across tenants (self-clocked: each job's virtual finish is
  ``max(V, tenant's last finish) + rows / weight``), then arrival. One noisy tenant only
  lengthens its own queue.
- **Admission.** A job is rejected at once when its tenant is over its row-rate limit,
  when the queue's row bound is reached, or when the work ordered ahead of it (what is
  running now, then every queued job that goes first) plus its own predicted run time
  ends past its deadline. Deadlines are ``arrival + target`` or the request's own
  timeout, whichever is sooner.
- **Dispatch.** When the executor is free: drop cancelled jobs and those that can no
  longer finish in time, then take jobs in order up to ``max_dispatch_rows``. Waiting
  for more rows pays only by merging them into this pass, which saves a dispatch's fixed
  cost ``a`` (the learned per-dispatch overhead of the server plus the pass model's
  fixed cost, scaled as the server runs it: ``CostEstimator.fixed_s``); with arrivals
  at rate ``λ`` rows/s (measured from recent gaps), waiting ``δ`` saves
  ``a (1 - e^{-λδ})`` of executor time and costs ``δ`` of it, so the best wait is
  ``δ* = ln(aλ)/λ`` when ``aλ > 1`` and none otherwise. It is taken from the last
  arrival, and only while every job in the pass still meets its deadline after it.
  On a CPU ``a`` is small and the policy dispatches at once until requests arrive
  faster than one per dispatch's fixed cost; on a GPU ``a`` dominates and it waits
  while requests keep arriving faster than one per ``a``.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import enum
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Final

from coalesce.batching.costmodel import CostModel

#: Triton's priority levels: 1 is the highest; 0 means "the model's default level".
DEFAULT_PRIORITY: Final = 0
#: Weight of the arrival-gap moving average (per arrival).
RATE_EWMA_WEIGHT: Final = 0.2
#: Bounds of the learned correction of every prediction (actual over predicted dispatch time).
MIN_SCALE: Final = 0.5
MAX_SCALE: Final = 8.0
#: Weight of the moving averages of the cost model's error and correction (per dispatch).
ERROR_EWMA_WEIGHT: Final = 0.1
#: Deadlines are planned with this quantile of recent actual over predicted dispatch times: the
#: model predicts the mean, and a p99 target is missed by the slow dispatches (on a shared, busy
#: machine one dispatch in ten ran 1.5-2x its prediction here).
TAIL_QUANTILE: Final = 0.9
MIN_TAIL_SAMPLES: Final = 16
MAX_TAIL_RATIO: Final = 4.0
#: Longest predicted run of one dispatch, as a share of the latency target.
MAX_DISPATCH_SHARE_OF_TARGET: Final = 0.5
#: How far (as a share of the target) the plan's start may move before the cached plan is recomputed.
PLAN_SHIFT_SHARE_OF_TARGET: Final = 0.02
#: The default tenant of requests that name none.
DEFAULT_TENANT: Final = "default"


class Rejection(enum.Enum):
    """Why a job was answered without being computed; ``value`` is the metric label."""

    DEADLINE = "deadline"      # at admission: the queue ahead of it makes it miss its deadline
    QUEUE_FULL = "queue_full"  # at admission: max_queue_rows or max_queue_bytes reached
    RATE_LIMIT = "rate_limit"  # at admission: its tenant is over its row-rate limit
    EXPIRED = "expired"        # at dispatch: can no longer finish in time
    CANCELLED = "cancelled"    # at dispatch: the client cancelled it


@dataclasses.dataclass
class Job:
    """One request in the backend's queue, as the policy sees it.

    Attributes:
        seq: Arrival order, unique.
        arrival_s: When it reached the backend.
        deadline_s: When its answer is due.
        rows: Rows in it.
        tokens: Sum of its rows' lengths (positions).
        max_length: Its longest row, in positions.
        tenant: Fair-queuing class.
        priority: Triton priority level (1 highest), after mapping 0 to the default level.
        payload: The adapter's own data (request, response sender); never read here.
        is_cancelled: Asks whether the client has cancelled it.
        virtual_finish: Fair-queuing tag, set at admission.
        size_bytes: Bytes of its inputs as sent (bounded in the queue by ``max_queue_bytes``).
    """

    seq: int
    arrival_s: float
    deadline_s: float
    rows: int
    tokens: int
    max_length: int
    tenant: str = DEFAULT_TENANT
    priority: int = 1
    payload: Any = None
    is_cancelled: Callable[[], bool] | None = None
    virtual_finish: float = 0.0
    size_bytes: int = 0

    def order_key(self) -> tuple[int, float, int]:
        """Service order: priority level, then fair-queuing finish tag, then arrival."""
        return (self.priority, self.virtual_finish, self.seq)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What the policy is asked to achieve, from the model's settings."""

    target_s: float
    max_queue_rows: int
    max_dispatch_rows: int
    max_batch_rows: int
    #: Most bytes of requests queued (0: no limit).
    max_queue_bytes: int = 0
    tenant_weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    tenant_max_rows_per_s: Mapping[str, float] = dataclasses.field(default_factory=dict)
    default_priority: int = 1
    #: Fraction added to predicted run times before comparing them with deadlines.
    safety: float = 0.1
    #: Jobs are asked whether their client cancelled them only once they have waited this share of
    #: their budget or ``cancel_check_wait_s``, whichever is sooner: each question is a round trip to
    #: the server process (~150 us measured on Triton 2.51), and a request dispatched within
    #: milliseconds of its arrival is all but never cancelled.
    cancel_check_share: float = 0.1
    cancel_check_wait_s: float = 0.02
    #: Longest predicted run, as a share of the target, that ``execute`` may run inline on an idle
    #: executor (0: never; see ``coalesce.scheduling.driver.AdaptiveScheduler.submit``).
    inline_share: float = 0.1

    def asks_if_cancelled(self, waited_s: float, budget_s: float) -> bool:
        """Whether a job that waited ``waited_s`` of ``budget_s`` is asked about cancellation before it runs."""
        return waited_s >= min(self.cancel_check_share * budget_s, self.cancel_check_wait_s)

    def weight(self, tenant: str) -> float:
        """Fair-queuing weight of ``tenant`` (1 unless configured)."""
        return self.tenant_weights.get(tenant, 1.0)


class DispatchWindow:
    """The last ``size`` dispatches as (pass-model seconds, actual seconds), with what fitting them needs kept current.

    A dispatch's learning runs on the request path (an inline run answers after it), so
    it is O(1): the sums of the weighted line fit and a sorted copy of the actual over
    predicted ratios are updated per dispatch instead of refitted with numpy (~0.3 ms a
    dispatch, paid by every request at concurrency 1). The sums are recomputed exactly
    once per window so that rounding does not accumulate.
    """

    def __init__(self, size: int) -> None:
        """Keep the last ``size`` dispatches."""
        self.size = size
        self._items: collections.deque[tuple[float, float]] = collections.deque()
        self._ratios: collections.deque[float] = collections.deque()
        self.sorted_ratios: list[float] = []
        # Weights 1/actual^2 (relative error): sum w, w*raw, w*actual, w*raw^2, w*raw*actual; and plain sums.
        self._sums = [0.0] * 7
        self._since_exact = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, raw_s: float, actual_s: float, ratio: float | None) -> None:
        """Add one dispatch (and its actual over predicted ``ratio``, if it had a prediction)."""
        if len(self._items) == self.size:
            self._apply(*self._items.popleft(), sign=-1.0)
        self._items.append((raw_s, actual_s))
        self._apply(raw_s, actual_s, sign=1.0)
        if ratio is not None:
            if len(self._ratios) == self.size:
                gone = self._ratios.popleft()
                del self.sorted_ratios[bisect.bisect_left(self.sorted_ratios, gone)]
            self._ratios.append(ratio)
            bisect.insort(self.sorted_ratios, ratio)
        self._since_exact += 1
        if self._since_exact >= self.size:
            self._since_exact = 0
            self._sums = [0.0] * 7
            for raw, actual in self._items:
                self._apply(raw, actual, sign=1.0)

    def _apply(self, raw: float, actual: float, *, sign: float) -> None:
        w = sign / (actual * actual)
        sums = self._sums
        sums[0] += w
        sums[1] += w * raw
        sums[2] += w * actual
        sums[3] += w * raw * raw
        sums[4] += w * raw * actual
        sums[5] += sign * raw
        sums[6] += sign * actual

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the ratios (linear interpolation, as numpy's default)."""
        values = self.sorted_ratios
        position = q * (len(values) - 1)
        low = int(position)
        high = min(low + 1, len(values) - 1)
        return values[low] + (values[high] - values[low]) * (position - low)

    def spread(self) -> float:
        """Largest less smallest pass-model time, over their mean (0 when empty)."""
        if not self._items:
            return 0.0
        raws = [raw for raw, _ in self._items]
        mean = self._sums[5] / len(raws)
        return (max(raws) - min(raws)) / mean if mean > 0 else 0.0

    def line(self) -> tuple[float, float] | None:
        """``(overhead, scale)`` of ``actual = overhead + scale * raw`` by weighted least squares (None: degenerate)."""
        w, wx, wy, wxx, wxy = self._sums[:5]
        det = w * wxx - wx * wx
        if det <= 1e-12 * w * wxx:
            return None
        scale = (w * wxy - wx * wy) / det
        return (wy - scale * wx) / w, scale

    def ratio(self) -> float:
        """Sum of actual over sum of pass-model times."""
        return self._sums[6] / self._sums[5] if self._sums[5] > 0 else 1.0


class CostEstimator:
    """Predicted run time of a dispatch, from a cost model that keeps learning.

    Two things are learned. Every forward pass is added to a window, and the pass model
    (``a + b*rows*len + c*rows*len^2``) is refitted to it every ``refit_every`` passes,
    starting from the samples calibrated at load. And every whole dispatch (tokenising,
    the planner's cuts and padding, pooling, the answers, and whatever else the machine
    did meanwhile) is compared with what the pass model predicted for it: a line
    ``actual = overhead_s + scale * predicted`` fitted over the recent dispatches turns
    pass-model time into the time the server really sees, per dispatch. ``error`` is
    the moving average of ``|actual - predicted| / actual`` per dispatch, as predicted.
    """

    def __init__(self, model: CostModel, samples: Iterable[tuple[int, int, float]] = (), *,
                 window: int = 256, refit_every: int = 32, dispatch_window: int = 64) -> None:
        """Start from ``model``; ``samples`` (rows, length, seconds) seed the refits."""
        self.model = model
        self._seed = list(samples)
        self._recent: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0
        self._dispatches = DispatchWindow(dispatch_window)
        self.scale = 1.0
        self.overhead_s = 0.0
        self.error = 0.0
        self.observed = 0
        #: The TAIL_QUANTILE of recent actual over predicted dispatch times (1.0 until enough are seen).
        self.tail_ratio = 1.0

    def pass_s(self, rows: int, length: int) -> float:
        """Predicted seconds of one forward pass (the pass model alone)."""
        return float(self.model.predict_s(rows, length))

    def raw_work_s(self, rows: int, tokens: int, max_length: int, max_batch_rows: int) -> float:
        """Pass-model seconds of ``rows`` rows of ``tokens`` tokens in all, none longer than ``max_length``.

        The planner pads each pass to its own longest row; with rows sorted by length
        the padding is small, so tokens are counted as they are, with the quadratic
        (attention) term at the rows' mean length, and one fixed cost per pass.
        """
        if rows <= 0:
            return 0.0
        m = self.model
        mean_length = tokens / rows
        passes = math.ceil(rows / max_batch_rows)
        return m.a_s * passes + m.b_s * tokens + m.c_s * tokens * min(mean_length, max_length)

    @property
    def fixed_s(self) -> float:
        """Predicted seconds a dispatch costs whatever its rows: what merging two dispatches into one saves."""
        return self.overhead_s + self.scale * self.model.a_s

    def work_s(self, rows: int, tokens: int, max_length: int, max_batch_rows: int) -> float:
        """Predicted seconds of one dispatch of these rows, as the server runs it."""
        if rows <= 0:
            return 0.0
        return self.overhead_s + self.scale * self.raw_work_s(rows, tokens, max_length, max_batch_rows)

    def observe(self, rows: int, length: int, seconds: float) -> None:
        """Learn from one forward pass that took ``seconds``."""
        self.observed += 1
        self._recent.append((rows, length, seconds))
        self._since_fit += 1
        if self._since_fit >= self._refit_every:
            self._since_fit = 0
            self.model = CostModel.fit([*self._seed, *self._recent])

    def observe_dispatch(self, raw_s: float, predicted_s: float, actual_s: float) -> None:
        """Learn from one dispatch: pass-model time ``raw_s``, predicted ``predicted_s``, and ``actual_s`` taken."""
        if raw_s <= 0 or actual_s <= 0:
            return
        error = abs(actual_s - predicted_s) / actual_s
        self.error = error if not len(self._dispatches) else (
            (1 - ERROR_EWMA_WEIGHT) * self.error + ERROR_EWMA_WEIGHT * error)
        window = self._dispatches
        window.add(raw_s, actual_s, actual_s / predicted_s if predicted_s > 0 else None)
        if len(window.sorted_ratios) >= MIN_TAIL_SAMPLES:
            self.tail_ratio = min(MAX_TAIL_RATIO, window.quantile(TAIL_QUANTILE))
        if len(window) >= 8 and window.spread() > 0.2:
            # Least squares of actual on raw, weighted by 1/actual (relative error), within sane bounds.
            fit = window.line()
            if fit is not None and MIN_SCALE <= fit[1] <= MAX_SCALE and fit[0] >= 0:
                self.overhead_s, self.scale = fit
                return
        # Too few or too alike to separate the two: a plain ratio.
        self.overhead_s = 0.0
        self.scale = min(MAX_SCALE, max(MIN_SCALE, window.ratio()))


@dataclasses.dataclass(frozen=True)
class Group:
    """A dispatch as planned: its jobs, when it would end, its predicted run time, and its earliest deadline."""

    jobs: list[Job]
    end_s: float
    work_s: float
    due_s: float


@dataclasses.dataclass(frozen=True)
class _Tail:
    """The last dispatch of a plan, as running sums, so a job for the end of the queue is admitted in O(1)."""

    start_s: float
    rows: int
    tokens: int
    longest: int
    due_s: float
    work_s: float
    margin: float

    @property
    def end_s(self) -> float:
        return self.start_s + self.work_s * self.margin


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """Run these jobs now, together: predicted to take ``predicted_s`` (``raw_s`` by the pass model alone)."""

    jobs: list[Job]
    predicted_s: float
    raw_s: float = 0.0
    #: Jobs taken off the queue without being computed: they would have been answered late.
    expired: list[Job] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Wait:
    """Nothing to run before ``until_s`` unless a job arrives (``until_s`` is inf when the queue is empty)."""

    until_s: float


class _TokenBucket:
    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.capacity = rate  # one second of traffic as burst
        self.level = rate
        self.stamp = now

    def take(self, amount: float, now: float) -> bool:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        # A request larger than the whole bucket may pass when the bucket is full, so it is not refused forever.
        if amount <= self.level or self.level >= self.capacity:
            self.level -= amount
            return True
        return False


class AdaptiveQueue:
    """The backend's queue under the adaptive policy (not thread-safe: ``coalesce.scheduling.driver`` holds a lock)."""

    def __init__(self, config: SchedulerConfig, cost: CostEstimator) -> None:
        """An empty queue."""
        self.config = config
        self.cost = cost
        self._jobs: list[Job] = []
        self._rows = 0
        self._bytes = 0
        self._virtual_time = 0.0
        self._last_finish: dict[str, float] = {}
        self._buckets: dict[str, _TokenBucket] = {}
        self._version = 0  # bumped on every change of the queue: invalidates the cached plan tail
        self._tail_cache: tuple[float, int, _Tail] | None = None
        #: Predicted answer time of the job last given to ``admit`` (for refusal messages).
        self.last_finish_s = 0.0
        self._last_arrival_s: float | None = None
        self._gap_per_row_s: float | None = None
        self._seq = 0

    # -- state ----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Jobs queued."""
        return len(self._jobs)

    @property
    def rows(self) -> int:
        """Rows queued."""
        return self._rows

    @property
    def size_bytes(self) -> int:
        """Bytes of the requests queued (``Job.size_bytes``)."""
        return self._bytes

    def over_bytes(self, job: Job) -> bool:
        """Whether queuing ``job`` would pass ``max_queue_bytes``."""
        limit = self.config.max_queue_bytes
        return bool(limit) and self._bytes + job.size_bytes > limit

    def take_all(self) -> list[Job]:
        """Remove and return every queued job (the driver answers them when its thread fails)."""
        jobs, self._jobs = self._jobs, []
        self._rows = self._bytes = 0
        self._tail_cache = None
        self._changed()
        return jobs

    @property
    def arrival_rate_rows_per_s(self) -> float:
        """Recent arrival rate, from the moving average of the gaps between arrivals (0 before two arrivals)."""
        if not self._gap_per_row_s:
            return 0.0 if self._gap_per_row_s is None else math.inf
        return 1.0 / self._gap_per_row_s

    def next_seq(self) -> int:
        """A fresh arrival number."""
        self._seq += 1
        return self._seq

    @property
    def margin(self) -> float:
        """Factor on predicted run times when they are compared with deadlines.

        At least ``1 + safety``; more when recent dispatches ran slower than predicted
        (the ``TAIL_QUANTILE`` of actual over predicted).
        """
        return max(1 + self.config.safety, self.cost.tail_ratio)

    def cost_changed(self) -> None:
        """Drop plans cached under the old costs (call after the estimator learned)."""
        self._changed()

    def job_work_s(self, job: Job) -> float:
        """Predicted seconds of ``job`` alone."""
        return self.cost.work_s(job.rows, job.tokens, job.max_length, self.config.max_batch_rows)

    # -- admission ------------------------------------------------------------------------------------

    def admit(self, job: Job, now: float, busy_until_s: float) -> Rejection | None:
        """Queue ``job``, or say why it is refused; ``busy_until_s`` is when the running dispatch should end."""
        self._note_arrival(now, job.rows)
        limit = self.config.tenant_max_rows_per_s.get(job.tenant)
        if limit is not None:
            bucket = self._buckets.get(job.tenant)
            if bucket is None:
                bucket = self._buckets[job.tenant] = _TokenBucket(limit, now)
            if not bucket.take(job.rows, now):
                return Rejection.RATE_LIMIT
        if self._rows + job.rows > self.config.max_queue_rows or self.over_bytes(job):
            return Rejection.QUEUE_FULL
        start = max(self._virtual_time, self._last_finish.get(job.tenant, 0.0))
        job.virtual_finish = start + job.rows / self.config.weight(job.tenant)
        at = bisect.bisect_right(self._jobs, job.order_key(), key=Job.order_key)
        plan_start = max(now, busy_until_s)
        if at == len(self._jobs):
            # The common case, a job for the end of the queue: only the last planned dispatch matters.
            tail = self._tail(plan_start)
            joined = self._join(tail, job) if tail is not None else None
            if joined is not None:
                new_tail = joined
            else:
                begin = tail.end_s if tail is not None else plan_start
                new_tail = _Tail(begin, job.rows, job.tokens, job.max_length, job.deadline_s, self.job_work_s(job),
                                 self.margin)
            self.last_finish_s = new_tail.end_s
        else:
            new_tail = None
            self.last_finish_s = self.predicted_finish_s(job, now, busy_until_s)
        if self.last_finish_s > job.deadline_s:
            return Rejection.DEADLINE
        self._last_finish[job.tenant] = job.virtual_finish
        bisect.insort_right(self._jobs, job, key=Job.order_key)  # kept in service order
        self._rows += job.rows
        self._bytes += job.size_bytes
        self._changed()
        if new_tail is not None:
            self._tail_cache = (plan_start, self._version, new_tail)
        return None

    def predicted_finish_s(self, job: Job, now: float, busy_until_s: float) -> float:
        """When ``job`` would be answered if queued now: the dispatches planned ahead of it, then its own."""
        at = bisect.bisect_right(self._jobs, job.order_key(), key=Job.order_key)
        ordered = [*self._jobs[:at], job, *self._jobs[at:]]
        for group in self.plan(ordered, max(now, busy_until_s)):
            if any(j is job for j in group.jobs):
                return group.end_s
        raise AssertionError("unreachable: every job is in a group")

    def _tail(self, plan_start: float) -> _Tail | None:
        """The last dispatch of the plan from ``plan_start`` (cached while the queue and the start stay the same)."""
        if not self._jobs:
            return None
        cached = self._tail_cache
        if cached is not None and cached[1] == self._version:
            # The plan's start moves with the clock while a dispatch overruns its prediction. A small
            # move shifts every dispatch alike (re-planning would only change a cut that a deadline
            # makes binding within that much); a larger one re-plans.
            shift = plan_start - cached[0]
            if 0 <= shift <= self.config.target_s * PLAN_SHIFT_SHARE_OF_TARGET:
                return dataclasses.replace(cached[2], start_s=cached[2].start_s + shift)
        last = None
        for group in self.plan(self._jobs, plan_start):
            last = group
        assert last is not None
        jobs = last.jobs
        tail = _Tail(last.end_s - last.work_s * self.margin, sum(j.rows for j in jobs),
                     sum(j.tokens for j in jobs), max(j.max_length for j in jobs), last.due_s, last.work_s,
                     self.margin)
        self._tail_cache = (plan_start, self._version, tail)
        return tail

    def _join(self, tail: _Tail, job: Job) -> _Tail | None:
        """``tail`` with ``job`` in it, if ``plan`` would put it there; else None."""
        rows, tokens, longest = tail.rows + job.rows, tail.tokens + job.tokens, max(tail.longest, job.max_length)
        work = self.cost.work_s(rows, tokens, longest, self.config.max_batch_rows)
        margin = self.margin
        if (rows > self.config.max_dispatch_rows or work * margin > self.config.target_s * MAX_DISPATCH_SHARE_OF_TARGET
                or tail.start_s + work * margin > min(tail.due_s, job.deadline_s)):
            return None
        return _Tail(tail.start_s, rows, tokens, longest, min(tail.due_s, job.deadline_s), work, margin)

    def _changed(self) -> None:
        self._version += 1

    def plan(self, ordered: list[Job], start_s: float) -> Iterator[Group]:
        """Cut jobs, in service order, into the dispatches the policy would run back to back from ``start_s``.

        A dispatch answers every job at its end, so a later job joins one only while
        it fits ``max_dispatch_rows``, the dispatch stays within half the target, and
        every job in it, the new one included, still ends by its deadline; otherwise it
        starts the next dispatch. Admission and
        dispatch plan alike, so what admission promised is what dispatch keeps.
        """
        margin = self.margin
        limit_rows, pass_rows = self.config.max_dispatch_rows, self.config.max_batch_rows
        # Dispatches are not preempted: keeping each within half the target leaves a request that
        # arrives just as one starts (a quiet tenant's, a higher priority's) half its budget.
        longest_run = self.config.target_s * MAX_DISPATCH_SHARE_OF_TARGET
        group: list[Job] = []
        rows = tokens = longest = 0
        due = math.inf
        work = 0.0
        for job in ordered:
            if group:
                with_job = self.cost.work_s(rows + job.rows, tokens + job.tokens, max(longest, job.max_length),
                                            pass_rows)
                if (rows + job.rows <= limit_rows and with_job * margin <= longest_run
                        and start_s + with_job * margin <= min(due, job.deadline_s)):
                    group.append(job)
                    rows, tokens, longest = rows + job.rows, tokens + job.tokens, max(longest, job.max_length)
                    due, work = min(due, job.deadline_s), with_job
                    continue
                yield Group(group, start_s + work * margin, work, due)
                start_s += work * margin
            group, rows, tokens, longest, due = [job], job.rows, job.tokens, job.max_length, job.deadline_s
            work = self.cost.work_s(rows, tokens, longest, pass_rows)
        if group:
            yield Group(group, start_s + work * margin, work, due)

    def _note_arrival(self, now: float, rows: int) -> None:
        if self._last_arrival_s is not None:
            gap = max(0.0, now - self._last_arrival_s) / max(rows, 1)
            self._gap_per_row_s = gap if self._gap_per_row_s is None else (
                (1 - RATE_EWMA_WEIGHT) * self._gap_per_row_s + RATE_EWMA_WEIGHT * gap)
        self._last_arrival_s = now

    # -- dispatch -------------------------------------------------------------------------------------

    def purge(self, now: float) -> list[tuple[Job, Rejection]]:
        """Remove and return the jobs that can no longer finish by their deadline, even alone.

        Cancellation is asked of the jobs a dispatch takes, just before they run
        (``coalesce.scheduling.driver``): asking every queued job on every wake-up would cost a
        round trip to the server each.
        """
        dropped: list[tuple[Job, Rejection]] = []
        kept: list[Job] = []
        for job in self._jobs:
            if now + self.job_work_s(job) > job.deadline_s:
                dropped.append((job, Rejection.EXPIRED))
            else:
                kept.append(job)
        if dropped:
            self._jobs = kept
            self._rows = sum(j.rows for j in kept)
            self._bytes = sum(j.size_bytes for j in kept)
            self._changed()
        return dropped

    def optimal_wait_s(self) -> float:
        """``δ*``: how long after the last arrival waiting for more rows still pays (0: it does not)."""
        a = self.cost.fixed_s
        rate = self.arrival_rate_rows_per_s
        if math.isinf(rate):
            return a  # arrivals closer together than the clock resolves: a burst is still coming
        if a * rate <= 1.0:
            return 0.0
        return math.log(a * rate) / rate

    def decide(self, now: float) -> Dispatch | Wait:
        """With the executor free: what to run now, or until when to wait (call ``purge`` first).

        When the queue runs behind its plan (the machine was slower than predicted), the
        oldest jobs may have too little time left to share a pass with anyone; shrinking
        every dispatch to them would cut throughput just when it is needed most. So the
        dispatch is the prefix (in service order, within the row and run-time caps) that
        answers the most jobs in time, and the jobs in it that would still be late are
        refused (``Dispatch.expired``) rather than computed for nothing.
        """
        choice = self._choose(now)
        if isinstance(choice, Wait):
            return choice
        return self._commit(*choice)

    def decide_within(self, now: float, max_run_s: float) -> Dispatch | None:
        """What ``decide`` would dispatch now, taken only if its predicted run (with the margin) fits ``max_run_s``.

        None (the queue unchanged) when the policy would wait or the run is longer.
        """
        choice = self._choose(now)
        if isinstance(choice, Wait) or choice[1] * self.margin > max_run_s:
            return None
        return self._commit(*choice)

    def _choose(self, now: float) -> Wait | tuple[list[Job], float, list[Job]]:
        """``decide`` without touching the queue: Wait, or (jobs to run, their predicted run, jobs to refuse)."""
        if not self._jobs:
            return Wait(math.inf)
        ordered = self._jobs
        first = next(self.plan(ordered, now))
        full = len(first.jobs) < len(ordered) or sum(j.rows for j in first.jobs) >= self.config.max_dispatch_rows
        if not full and self._last_arrival_s is not None:
            until = self._last_arrival_s + self.optimal_wait_s()
            # Waiting must leave every job of the dispatch time to finish: its deadline, less the run, less the margin.
            if now < until <= first.due_s - first.work_s * self.margin:
                return Wait(until)
        chosen, late = self._most_on_time(ordered, now)
        if len(chosen) <= len(first.jobs):
            return first.jobs, first.work_s, []
        return chosen, self.cost.work_s(sum(j.rows for j in chosen), sum(j.tokens for j in chosen),
                                        max(j.max_length for j in chosen), self.config.max_batch_rows), late

    def _commit(self, chosen: list[Job], predicted_s: float, late: list[Job]) -> Dispatch:
        taken = self._take(chosen, predicted_s)
        if not late:
            return taken
        self._remove(late)
        return dataclasses.replace(taken, expired=late)

    def _most_on_time(self, ordered: list[Job], now: float) -> tuple[list[Job], list[Job]]:
        """The prefix that answers the most jobs by their deadlines, split into (on time, late)."""
        margin = self.margin
        longest_run = self.config.target_s * MAX_DISPATCH_SHARE_OF_TARGET
        deadlines: list[float] = []
        rows = tokens = longest = 0
        best_count, best_size, best_end = -1, 0, 0.0
        for size, job in enumerate(ordered, start=1):
            if size > 1 and rows + job.rows > self.config.max_dispatch_rows:
                break
            work = self.cost.work_s(rows + job.rows, tokens + job.tokens, max(longest, job.max_length),
                                    self.config.max_batch_rows) * margin
            if size > 1 and work > longest_run:
                break
            rows, tokens, longest = rows + job.rows, tokens + job.tokens, max(longest, job.max_length)
            bisect.insort(deadlines, job.deadline_s)
            on_time = len(deadlines) - bisect.bisect_left(deadlines, now + work)
            if on_time >= best_count:
                best_count, best_size, best_end = on_time, size, now + work
        prefix = ordered[:best_size]
        return [j for j in prefix if j.deadline_s >= best_end], [j for j in prefix if j.deadline_s < best_end]

    def _remove(self, jobs: list[Job]) -> None:
        gone = {id(j) for j in jobs}
        if gone:
            self._jobs = [j for j in self._jobs if id(j) not in gone]
            self._rows -= sum(j.rows for j in jobs)
            self._bytes -= sum(j.size_bytes for j in jobs)
            self._changed()

    def _take(self, chosen: list[Job], predicted: float) -> Dispatch:
        taken = {id(j) for j in chosen}
        self._jobs = [j for j in self._jobs if id(j) not in taken]
        self._rows -= sum(j.rows for j in chosen)
        self._bytes -= sum(j.size_bytes for j in chosen)
        self._changed()
        self._virtual_time = max(self._virtual_time, max(j.virtual_finish for j in chosen))
        # Tenants with nothing queued and a finish tag behind virtual time need no state.
        for tenant in [t for t, f in self._last_finish.items() if f <= self._virtual_time]:
            if not any(j.tenant == tenant for j in self._jobs):
                del self._last_finish[tenant]
        raw = self.cost.raw_work_s(sum(j.rows for j in chosen), sum(j.tokens for j in chosen),
                                   max(j.max_length for j in chosen), self.config.max_batch_rows)
        return Dispatch(chosen, predicted, raw)

