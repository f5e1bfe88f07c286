"""The embedding pipeline: decode -> tokenise -> coalesce -> run -> pool -> scatter.

``EmbeddingPipeline.embed`` takes every request of one ``execute`` at once and
returns one result per request, in order: an ``[rows, dim]`` float32 array, or the
``CoalesceError`` that request earned. A bad request never costs its neighbours
their answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from coalesce.coalescer import PlanLimits, SubBatch, plan_sub_batches, plan_sub_batches_dp
from coalesce.costmodel import CostModel, calibrate
from coalesce.errors import CoalesceError, ConfigError, InvalidInputError
from coalesce.log import Logger
from coalesce.metrics import InMemoryMetricFactory, MetricFactory, PipelineMetrics
from coalesce.pooling import pool
from coalesce.runtime import Runtime, create_runtime
from coalesce.settings import Settings
from coalesce.tokenizer import TextTokenizer

#: What the adapter hands over per request: its raw rows, or the error found while reading it.
RequestInput = Sequence[bytes | str] | CoalesceError
#: What the pipeline answers per request.
RequestResult = np.ndarray | CoalesceError


class EmbeddingPipeline:
    """Coalesces the rows of many requests into few, tightly padded forward passes."""

    def __init__(self, settings: Settings, runtime: Runtime, tokenizer: TextTokenizer,
                 metrics: PipelineMetrics, logger: Logger | None = None) -> None:
        """Wire the pipeline; use ``from_version_dir`` to build one from files.

        Raises:
            ConfigError: If the runtime's hidden width disagrees with the configured output dims.
        """
        if runtime.hidden_size != settings.embedding_dim:
            raise ConfigError(
                f"model '{settings.model_name}': output EMBEDDING has dims [{settings.embedding_dim}] "
                f"but the {runtime.name} model produces width {runtime.hidden_size}")
        self.settings = settings
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.logger = logger or Logger(settings.model_name)
        self.limits = PlanLimits(max_rows=settings.max_batch_rows, max_tokens=settings.max_batch_tokens,
                                 max_padding_ratio=settings.max_padding_ratio)
        self.cost_model = self._cost_model()

    @classmethod
    def from_version_dir(cls, settings: Settings, version_dir: Path, *, version: str = "1",
                         metric_factory: MetricFactory | None = None,
                         logger: Logger | None = None) -> EmbeddingPipeline:
        """Build the tokenizer, runtime and metrics from a model version folder."""
        logger = logger or Logger(settings.model_name)
        tokenizer = TextTokenizer(version_dir / settings.tokenizer_file, settings.max_sequence_length)
        choice = create_runtime(settings, version_dir)
        logger.info(choice.reason)
        metrics = PipelineMetrics(metric_factory or InMemoryMetricFactory(), model=settings.model_name,
                                  version=version)
        return cls(settings, choice.runtime, tokenizer, metrics, logger)

    def _cost_model(self) -> CostModel:
        if self.settings.cost_model != "auto":
            return CostModel.parse(self.settings.cost_model)
        start = time.perf_counter()
        model, samples = calibrate(self.runtime, max_rows=self.settings.max_batch_rows,
                                   max_tokens=self.settings.max_batch_tokens,
                                   max_length=self.settings.max_sequence_length)
        self.logger.info(
            f"cost model calibrated in {time.perf_counter() - start:.2f} s: a,b,c = {model} "
            f"(set parameter cost_model to '{model}' to skip calibration); samples (rows, len, s): "
            + ", ".join(f"({r}, {n}, {s:.4f})" for r, n, s in samples))
        return model

    def plan(self, lengths: np.ndarray) -> list[SubBatch]:
        """Cut rows of the given token lengths into forward passes, by the configured planner."""
        if self.settings.planner == "greedy":
            return plan_sub_batches(lengths, self.limits)
        return plan_sub_batches_dp(lengths, self.limits, self.cost_model)

    def embed(self, requests: Sequence[RequestInput]) -> list[RequestResult]:
        """Embed the rows of all requests together; one result per request, in order."""
        metrics = self.metrics
        stage = metrics.stage_seconds
        metrics.executions.increment(1)
        metrics.requests.increment(len(requests))

        t0 = time.perf_counter()
        results: list[RequestResult | None] = [None] * len(requests)
        texts: list[str] = []
        spans: list[tuple[int, int, int]] = []  # (request index, first row, end row) in `texts`
        for index, request in enumerate(requests):
            if isinstance(request, CoalesceError):
                results[index] = request
                continue
            try:
                decoded = self._decode(request)
            except InvalidInputError as exc:
                results[index] = exc
                continue
            spans.append((index, len(texts), len(texts) + len(decoded)))
            texts.extend(decoded)
        metrics.rows.increment(len(texts))
        t1 = time.perf_counter()
        stage["decode"].observe(t1 - t0)

        if texts:
            self._compute(texts, spans, results)
        final = [r if r is not None else CoalesceError("internal: request got no result") for r in results]
        metrics.request_failures.increment(sum(isinstance(r, CoalesceError) for r in final))
        return final

    def _compute(self, texts: list[str], spans: list[tuple[int, int, int]],
                 results: list[RequestResult | None]) -> None:
        metrics = self.metrics
        stage = metrics.stage_seconds
        t0 = time.perf_counter()
        # In-flight de-duplication: identical rows of this execute (within or across requests)
        # are tokenised and computed once, then fanned out to every place they came from.
        first_index: dict[str, int] = {}
        inverse = np.fromiter((first_index.setdefault(t, len(first_index)) for t in texts), dtype=np.intp,
                              count=len(texts))
        distinct = list(first_index)
        metrics.deduplicated_rows.increment(len(texts) - len(distinct))
        encoded = self.tokenizer.encode(distinct)
        t1 = time.perf_counter()
        stage["tokenize"].observe(t1 - t0)
        plans = self.plan(encoded.lengths)
        t2 = time.perf_counter()
        stage["plan"].observe(t2 - t1)

        computed = np.empty((len(distinct), self.settings.embedding_dim), dtype=np.float32)
        failures: dict[int, CoalesceError] = {}  # distinct row -> the error of its pass
        infer_s = pool_s = 0.0
        for plan in plans:
            input_ids, mask, type_ids = encoded.padded(plan.rows, plan.padded_length)
            ta = time.perf_counter()
            try:
                hidden = self.runtime.run(input_ids, mask, type_ids)
            except CoalesceError as exc:
                # Only the requests with rows in this pass fail; the other passes go on.
                self.logger.error(f"forward pass of {len(plan.rows)} rows failed: {exc}")
                for row in plan.rows:
                    failures[int(row)] = exc
                infer_s += time.perf_counter() - ta
                continue
            tb = time.perf_counter()
            computed[plan.rows] = pool(hidden, mask, mode=self.settings.pooling, normalize=self.settings.normalize)
            infer_s += tb - ta
            pool_s += time.perf_counter() - tb
            metrics.forward_passes.increment(1)
            metrics.real_tokens.increment(plan.real_tokens)
            metrics.padded_tokens.increment(plan.padded_tokens)
            metrics.padding_ratio.observe(plan.padding_ratio)
            metrics.batch_rows.observe(len(plan.rows))
        stage["infer"].observe(infer_s)
        stage["pool"].observe(pool_s)

        t3 = time.perf_counter()
        out = computed[inverse]
        for index, lo, hi in spans:
            bad = [int(d) for d in inverse[lo:hi] if int(d) in failures] if failures else []
            results[index] = failures[bad[0]] if bad else out[lo:hi]
        stage["scatter"].observe(time.perf_counter() - t3)

    def _decode(self, rows: Sequence[bytes | str]) -> list[str]:
        if len(rows) == 0:
            raise InvalidInputError("input 'TEXT' has no rows: send at least one text (shape [N, 1], N >= 1)")
        limit = self.settings.max_text_bytes
        texts: list[str] = []
        for row, value in enumerate(rows):
            if isinstance(value, str):
                text = value
                size = len(value.encode("utf-8", errors="surrogatepass"))
            else:
                size = len(value)
                try:
                    text = bytes(value).decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InvalidInputError(
                        f"input 'TEXT' row {row} is not valid UTF-8: byte 0x{value[exc.start]:02x} "
                        f"at offset {exc.start} ({exc.reason})") from None
            if size > limit:
                raise InvalidInputError(
                    f"input 'TEXT' row {row} is {size} bytes, over the model's limit of {limit} "
                    "(parameter 'max_text_bytes')")
            texts.append(text)
        return texts
