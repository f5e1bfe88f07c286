"""The coalescing pipeline, for any task: read -> de-duplicate -> cache -> prepare -> plan -> run -> split -> scatter.

``Pipeline.run`` takes every request of one dispatch at once (their rows, as the task
read them) and returns one result per request, in order: the model's outputs by name
(``[rows, ...]`` each), or the ``CoalesceError`` that request earned. Identical rows are
computed once; rows found in the row cache are not computed at all; the rest are sorted
by length, cut into passes by the cost model and padded only to each pass's own longest
row. A bad request, or a failed pass, never costs the other requests their answers.
Nothing here knows what a row holds: the task does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from coalesce.batching.costmodel import CostModel
from coalesce.batching.planner import PlanLimits, SubBatch, plan_sub_batches, plan_sub_batches_dp
from coalesce.cache.keys import row_key
from coalesce.cache.memory import RowCache, RowOutputs
from coalesce.cache.shared import RedisTier, RowLayout
from coalesce.core.errors import CoalesceError, ConfigError, InvalidInputError, as_result
from coalesce.core.limits import oversize_error, request_bytes
from coalesce.core.task import Pass, Prepared, Row, Task
from coalesce.core.tensors import TensorSpec
from coalesce.observability.log import Logger
from coalesce.observability.metrics import PipelineMetrics
from coalesce.runtimes import Runtime
from coalesce.runtimes.cores import CoreBoard, marked
from coalesce.settings import PlannerOptions

#: What the pipeline runs per request: its rows as the task read them, or the error found reading it.
RequestInput = Sequence[Row] | CoalesceError
#: What the pipeline answers per request: the model's outputs by name, or the request's error.
RequestResult = dict[str, np.ndarray] | CoalesceError


class OutputTable:
    """The outputs of a dispatch's distinct rows: dense arrays for fixed shapes, one array per row where they vary."""

    def __init__(self, specs: Sequence[TensorSpec], count: int) -> None:
        """Room for ``count`` rows of the outputs ``specs``."""
        self.specs = tuple(specs)
        self._dense = {s.name: np.empty((count, *s.dims), dtype=s.dtype) for s in specs if not s.variable_axes}
        self._ragged: dict[str, list[np.ndarray | None]] = {
            s.name: [None] * count for s in specs if s.variable_axes}

    def put_pass(self, rows: np.ndarray, outputs: Mapping[str, np.ndarray], lengths: np.ndarray) -> None:
        """Store one pass's outputs (``[pass rows, ...]``) at table rows ``rows``, cutting each row to its length."""
        for spec in self.specs:
            value = outputs[spec.name]
            if spec.name in self._dense:
                self._dense[spec.name][rows] = value
                continue
            column = self._ragged[spec.name]
            for k, row in enumerate(rows):
                length = int(lengths[k])
                cut = tuple(slice(0, length) if d < 0 else slice(None) for d in spec.dims)
                column[int(row)] = np.array(value[k][cut], copy=True)

    def put_row(self, row: int, outputs: RowOutputs) -> None:
        """Store one row's outputs (in spec order), e.g. from the cache."""
        for spec, value in zip(self.specs, outputs, strict=True):
            if spec.name in self._dense:
                self._dense[spec.name][row] = value
            else:
                self._ragged[spec.name][row] = value

    def row(self, row: int) -> RowOutputs:
        """One row's outputs, in spec order."""
        return tuple(self._dense[s.name][row] if s.name in self._dense else self._ragged[s.name][row]  # type: ignore[misc]
                     for s in self.specs)

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The outputs of ``rows`` (one request's, in order) by name, ``[len(rows), ...]`` each."""
        out: dict[str, np.ndarray] = {}
        for spec in self.specs:
            if spec.name in self._dense:
                out[spec.name] = self._dense[spec.name][rows]
            else:
                column = self._ragged[spec.name]
                out[spec.name] = np.stack([column[int(r)] for r in rows])  # type: ignore[misc]
        return out


@dataclasses.dataclass(frozen=True)
class PassResult:
    """One pass run: what was fed, the model's outputs, seconds in the runtime (with assembling) and in the split."""

    batch: Pass
    outputs: dict[str, np.ndarray]
    run_s: float
    split_s: float


class Pipeline:
    """Coalesces the rows of many requests into few, tightly padded forward passes of one task."""

    def __init__(self, task: Task, runtime: Runtime, options: PlannerOptions, metrics: PipelineMetrics,
                 logger: Logger | None = None, *, cost_model: CostModel,
                 cost_samples: Sequence[tuple[int, int, float]] = (), cache: RowCache | None = None,
                 shared: RedisTier | None = None, fingerprint: bytes = b"", model_name: str = "model",
                 max_request_bytes: int = 0, board: CoreBoard | None = None) -> None:
        """Wire the pipeline; ``coalesce.loader.load_pipeline`` builds one from a model's files.

        ``board``: the server's core board, marked around each dispatch (``coalesce.runtimes.cores``).

        ``cache`` (the in-process tier) and ``shared`` (the Redis tier, asked for the rows
        the first tier misses), with the ``fingerprint`` of everything that decides the
        outputs (``coalesce.cache.keys.output_fingerprint``), answer rows computed before;
        without either, every row is computed. ``cost_samples`` are the calibration's, which
        the adaptive scheduler's learning starts from. A request of more than
        ``max_request_bytes`` (0: no limit) is refused before it is read.

        Raises:
            ConfigError: If the runtime cannot take the task's longest row.
            ValueError: If a cache is given without a fingerprint.
        """
        self.task = task
        self.runtime = runtime
        self.board = board
        self.options = options
        self.metrics = metrics
        self.model_name = model_name
        self.max_request_bytes = max_request_bytes
        self.logger = logger or Logger(model_name)
        # A runtime with fixed shape ranges (TensorRT profiles) bounds the passes the planner may cut; its rows
        # are graph rows, of which a task's row may take several (similarity: two texts).
        runtime_rows = getattr(runtime, "max_rows", None)
        if runtime_rows is not None:
            runtime_rows = max(1, runtime_rows // task.graph_rows_per_row)
        runtime_length = getattr(runtime, "max_length", None)
        if runtime_length is not None and task.max_length > runtime_length:
            raise ConfigError(
                f"model '{model_name}': max_sequence_length {task.max_length} exceeds the longest row the "
                f"{runtime.name} runtime takes ({runtime_length}); rebuild the engine")
        self.limits = PlanLimits(max_rows=min(options.max_batch_rows, runtime_rows or options.max_batch_rows),
                                 max_tokens=options.max_batch_tokens, max_padding_ratio=options.max_padding_ratio)
        self.cost_model = cost_model
        self.cost_samples = list(cost_samples)
        #: Called after every forward pass with (rows, padded length, seconds): the scheduler learns from them.
        self.pass_observers: list[Callable[[int, int, float], None]] = []
        self.cache = cache if cache is not None and cache.enabled else None
        self.shared = shared
        if (self.cache is not None or shared is not None) and len(fingerprint) < 16:
            raise ValueError("a row cache needs the output fingerprint its keys are made under")
        self.fingerprint = fingerprint
        self._variable_outputs = any(spec.variable_axes for spec in task.outputs)
        self._fixed_layout: RowLayout = tuple((spec.dtype, spec.dims) for spec in task.outputs)
        normalised = task.unit_norm_outputs()
        self._unit_norm = tuple(spec.name in normalised for spec in task.outputs)  # checked on shared-tier values

    def close(self) -> None:
        """Release what outlives a call: the shared tier's writer and connections."""
        if self.shared is not None:
            self.shared.close()

    # -- reading --------------------------------------------------------------------------------------

    def read(self, tensors: Mapping[str, np.ndarray] | CoalesceError) -> list[Row] | CoalesceError:
        """One request's rows from its input tensors, or the error it is to be answered with."""
        return self.read_sized(tensors)[0]

    def read_sized(self, tensors: Mapping[str, np.ndarray] | CoalesceError, *,
                   size_bytes: int | None = None) -> tuple[list[Row] | CoalesceError, int]:
        """``read``, and the request's size in bytes (``coalesce.core.limits.request_bytes``; 0 for an error).

        The size is checked against ``max_request_bytes`` before the task reads (copies,
        decodes) anything; ``size_bytes`` is that size where the caller measured it already.
        """
        if isinstance(tensors, CoalesceError):
            return tensors, 0
        size = request_bytes(tensors) if size_bytes is None else size_bytes
        if self.max_request_bytes and size > self.max_request_bytes:
            return oversize_error(size, self.max_request_bytes), 0
        try:
            return self.task.read(tensors), size
        except InvalidInputError as exc:
            return as_result(exc), 0

    def read_all(self, requests: Sequence[Mapping[str, np.ndarray] | CoalesceError]) -> list[RequestInput]:
        """``read`` for every request of an ``execute``, timed as the ``read`` stage."""
        start = time.perf_counter()
        rows: list[RequestInput] = [self.read(request) for request in requests]
        self.metrics.stage_seconds["read"].observe(time.perf_counter() - start)
        return rows

    def lengths(self, rows: Sequence[Row]) -> np.ndarray:
        """Each row's length in positions (what a pass over it costs)."""
        return self.task.lengths(rows)

    def plan(self, lengths: np.ndarray) -> list[SubBatch]:
        """Cut rows of the given lengths into forward passes, by the configured planner."""
        if self.options.planner == "greedy":
            return plan_sub_batches(lengths, self.limits)
        return plan_sub_batches_dp(lengths, self.limits, self.cost_model)

    # -- running --------------------------------------------------------------------------------------

    def run_pass(self, prepared: Prepared, indices: np.ndarray, padded_length: int) -> PassResult:
        """Assemble, run and split one pass over rows ``indices`` of ``prepared``.

        Raises:
            CoalesceError: If the runtime or the task's split fails on it.
        """
        task = self.task
        start = time.perf_counter()
        batch = Pass(prepared, indices, padded_length, task.assemble(prepared, indices, padded_length))
        raw = self.runtime.run(batch.feeds, task.graph_outputs)
        ran = time.perf_counter()
        outputs = task.split(batch, raw)
        return PassResult(batch, outputs, run_s=ran - start, split_s=time.perf_counter() - ran)

    def run(self, requests: Sequence[RequestInput]) -> list[RequestResult]:
        """Compute the rows of all requests together; one result per request, in order.

        Marked on the server's core board for its whole length, where the model shares the cores.
        """
        with marked(self.board):
            return self._run(requests)

    def _run(self, requests: Sequence[RequestInput]) -> list[RequestResult]:
        metrics = self.metrics
        metrics.executions.increment(1)
        metrics.requests.increment(len(requests))
        results: list[RequestResult | None] = [None] * len(requests)
        rows: list[Row] = []
        spans: list[tuple[int, int, int]] = []  # (request index, first row, end row) in `rows`
        for index, request in enumerate(requests):
            if isinstance(request, CoalesceError):
                results[index] = request
                continue
            spans.append((index, len(rows), len(rows) + len(request)))
            rows.extend(request)
        metrics.rows.increment(len(rows))
        if rows:
            self._compute(rows, spans, results)
        final = [r if r is not None else CoalesceError("internal: request got no result") for r in results]
        metrics.request_failures.increment(sum(isinstance(r, CoalesceError) for r in final))
        return final

    def _compute(self, rows: list[Row], spans: list[tuple[int, int, int]],
                 results: list[RequestResult | None]) -> None:
        metrics, task = self.metrics, self.task
        stage = metrics.stage_seconds
        t0 = time.perf_counter()
        # In-flight de-duplication: identical rows of this dispatch (within or across requests)
        # are prepared and computed once, then fanned out to every place they came from.
        keyed = [task.row_bytes(row) for row in rows]
        first: dict[bytes, int] = {}
        firsts: list[int] = []
        inverse = np.empty(len(rows), dtype=np.intp)
        for i, key in enumerate(keyed):
            d = first.get(key)
            if d is None:
                d = first[key] = len(firsts)
                firsts.append(i)
            inverse[i] = d
        distinct = [rows[i] for i in firsts]
        metrics.deduplicated_rows.increment(len(rows) - len(distinct))
        table = OutputTable(task.outputs, len(distinct))
        todo, keys = self._answer_from_cache(distinct, [keyed[i] for i in firsts], table)
        failures: dict[int, CoalesceError] = {}  # distinct row -> the error of its pass
        prepared = task.prepare([distinct[i] for i in todo]) if len(todo) else None
        t1 = time.perf_counter()
        stage["prepare"].observe(t1 - t0)
        # The coalescer plans over the misses alone.
        plans = self.plan(prepared.lengths) if prepared is not None else []
        t2 = time.perf_counter()
        stage["plan"].observe(t2 - t1)

        infer_s = split_s = 0.0
        done = np.zeros(len(todo), dtype=bool)
        for plan in plans:
            assert prepared is not None
            ta = time.perf_counter()
            try:
                done_pass = self.run_pass(prepared, plan.rows, plan.padded_length)
            except CoalesceError as exc:
                # Only the requests with rows in this pass fail; the other passes go on.
                self.logger.error(f"forward pass of {len(plan.rows)} rows failed: {exc}")
                failure = as_result(exc)
                for row in plan.rows:
                    failures[int(todo[row])] = failure
                infer_s += time.perf_counter() - ta
                continue
            for observe in self.pass_observers:
                observe(len(plan.rows), plan.padded_length, done_pass.run_s)
            table.put_pass(todo[plan.rows], done_pass.outputs, done_pass.batch.lengths)
            done[plan.rows] = True
            infer_s += done_pass.run_s
            split_s += done_pass.split_s
            metrics.forward_passes.increment(1)
            metrics.real_tokens.increment(plan.real_tokens)
            metrics.padded_tokens.increment(plan.padded_tokens)
            metrics.padding_ratio.observe(plan.padding_ratio)
            metrics.batch_rows.observe(len(plan.rows))
        stage["infer"].observe(infer_s)
        stage["split"].observe(split_s)
        if keys and done.any():
            stored = todo[done]
            stored_keys = [keys[i] for i in stored]
            stored_rows = [table.row(int(i)) for i in stored]
            if self.shared is not None:
                self.shared.put_many(stored_keys, stored_rows)  # queued; written off the request path
            if self.cache is not None:
                metrics.cache_evictions.increment(self.cache.put_many(stored_keys, stored_rows))
                metrics.cache_resident_bytes.set(self.cache.resident_bytes)

        t3 = time.perf_counter()
        for index, lo, hi in spans:
            mine = inverse[lo:hi]
            bad = [int(d) for d in mine if int(d) in failures] if failures else []
            results[index] = failures[bad[0]] if bad else table.gather(mine)
        stage["scatter"].observe(time.perf_counter() - t3)

    def _layouts(self, rows: Sequence[Row]) -> list[RowLayout]:
        """How each row's outputs are laid out (shapes follow the row's length where they vary)."""
        if not self._variable_outputs:
            return [self._fixed_layout] * len(rows)
        return [tuple((spec.dtype, spec.row_shape(int(length))) for spec in self.task.outputs)
                for length in self.task.lengths(rows)]

    def _answer_from_cache(self, distinct: list[Row], keyed: list[bytes],
                           table: OutputTable) -> tuple[np.ndarray, list[bytes]]:
        """Fill ``table`` with the cached rows; return the indices of the rows still to compute, and the keys."""
        if self.cache is None and self.shared is None:
            return np.arange(len(distinct)), []
        keys = [row_key(self.fingerprint, key) for key in keyed]
        missing = list(range(len(distinct)))
        if self.cache is not None:
            found = self.cache.get_many(keys)
            missing = [i for i, outputs in enumerate(found) if outputs is None]
            for i, outputs in enumerate(found):
                if outputs is not None:
                    table.put_row(i, outputs)
            self.metrics.cache_hits.increment(len(distinct) - len(missing))
            self.metrics.cache_misses.increment(len(missing))
        if self.shared is not None and missing:
            # One round trip for every row the first tier missed; a shared hit is kept in process too.
            shared = self.shared.get_many([keys[i] for i in missing], self._layouts([distinct[i] for i in missing]),
                                          self._unit_norm)
            hits: list[tuple[int, RowOutputs]] = [(i, outputs) for i, outputs in zip(missing, shared, strict=True)
                                                  if outputs is not None]
            for i, outputs in hits:
                table.put_row(i, outputs)
            if hits and self.cache is not None:
                self.metrics.cache_evictions.increment(
                    self.cache.put_many([keys[i] for i, _ in hits], [outputs for _, outputs in hits]))
                self.metrics.cache_resident_bytes.set(self.cache.resident_bytes)
            missing = [i for i, outputs in zip(missing, shared, strict=True) if outputs is None]
        return np.array(missing, dtype=np.intp), keys

