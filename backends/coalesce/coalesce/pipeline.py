"""The embedding pipeline: decode -> tokenise -> coalesce -> run -> pool -> scatter.

``EmbeddingPipeline.embed`` takes every request of one ``execute`` at once and
returns one result per request, in order: an ``[rows, dim]`` float32 array, or the
``CoalesceError`` that request earned. A bad request never costs its neighbours
their answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from coalesce.cache import RowCache, file_digest, output_fingerprint, row_key
from coalesce.coalescer import PlanLimits, SubBatch, plan_sub_batches, plan_sub_batches_dp
from coalesce.costmodel import CostModel, calibrate
from coalesce.errors import CoalesceError, ConfigError, InvalidInputError, as_result
from coalesce.log import Logger
from coalesce.metrics import InMemoryMetricFactory, MetricFactory, PipelineMetrics
from coalesce.pooling import pool
from coalesce.runtime import Runtime, create_runtime
from coalesce.runtime.bls import BlsCall
from coalesce.settings import Settings
from coalesce.shared_cache import RedisTier
from coalesce.tokenizer import TextTokenizer

#: Cost model of a BLS target when none is configured: 3 ms a pass, 2 us a token (a GPU encoder's order).
BLS_DEFAULT_COST = "0.003,0.000002,0"
#: What the adapter hands over per request: its raw rows, or the error found while reading it.
RequestInput = Sequence[bytes | str] | CoalesceError
#: What the pipeline answers per request.
RequestResult = np.ndarray | CoalesceError


class EmbeddingPipeline:
    """Coalesces the rows of many requests into few, tightly padded forward passes."""

    def __init__(self, settings: Settings, runtime: Runtime, tokenizer: TextTokenizer,
                 metrics: PipelineMetrics, logger: Logger | None = None, *,
                 cache: RowCache | None = None, shared: RedisTier | None = None,
                 fingerprint: bytes = b"") -> None:
        """Wire the pipeline; use ``from_version_dir`` to build one from files.

        ``cache`` (the in-process tier) and ``shared`` (the Redis tier, asked for the rows
        the first tier misses), with the ``fingerprint`` of everything that decides the
        output (see ``coalesce.cache.output_fingerprint``), answer rows computed before;
        without either, every row is computed.

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
        # A runtime with fixed shape ranges (TensorRT profiles) bounds the passes the planner may cut.
        runtime_rows = getattr(runtime, "max_rows", None)
        runtime_length = getattr(runtime, "max_length", None)
        if runtime_length is not None and settings.max_sequence_length > runtime_length:
            raise ConfigError(
                f"model '{settings.model_name}': max_sequence_length {settings.max_sequence_length} exceeds the "
                f"longest input the {runtime.name} runtime takes ({runtime_length}); rebuild the engine")
        self.limits = PlanLimits(max_rows=min(settings.max_batch_rows, runtime_rows or settings.max_batch_rows),
                                 max_tokens=settings.max_batch_tokens, max_padding_ratio=settings.max_padding_ratio)
        self.cost_samples: list[tuple[int, int, float]] = []
        self.cost_model = self._cost_model()
        #: Called after every forward pass with (rows, padded length, seconds): the scheduler learns from them.
        self.pass_observers: list[Callable[[int, int, float], None]] = []
        self.cache = cache if cache is not None and cache.enabled else None
        self.shared = shared
        if (self.cache is not None or shared is not None) and len(fingerprint) < 16:
            raise ValueError("a row cache needs the output fingerprint its keys are made under")
        self.fingerprint = fingerprint

    @classmethod
    def from_version_dir(cls, settings: Settings, version_dir: Path, *, version: str = "1",
                         metric_factory: MetricFactory | None = None, logger: Logger | None = None,
                         instance_kind: str = "CPU", device_id: int = 0,
                         bls_call: BlsCall | None = None) -> EmbeddingPipeline:
        """Build the tokenizer, runtime and metrics from a model version folder.

        ``instance_kind`` and ``device_id`` are the Triton instance's; ``bls_call`` lets
        the ``bls`` runtime send passes to another Triton model.
        """
        logger = logger or Logger(settings.model_name)
        tokenizer = TextTokenizer(version_dir / settings.tokenizer_file, settings.max_sequence_length)
        choice = create_runtime(settings, version_dir, instance_kind=instance_kind, device_id=device_id,
                                bls_call=bls_call)
        logger.info(choice.reason)
        metrics = PipelineMetrics(metric_factory or InMemoryMetricFactory(), model=settings.model_name,
                                  version=version)
        if not settings.caches_rows:
            return cls(settings, choice.runtime, tokenizer, metrics, logger)
        start = time.perf_counter()
        fingerprint = output_fingerprint({
            "model": settings.model_name, "version": version,
            "weights_sha256": file_digest(version_dir / settings.onnx_file),
            "tokenizer_sha256": file_digest(version_dir / settings.tokenizer_file),
            "max_sequence_length": settings.max_sequence_length, "pooling": settings.pooling,
            "normalize": settings.normalize, "runtime": choice.runtime.name,
            "precision": settings.precision if choice.runtime.name == "torch" else "fp32",
            **({"engine_sha256": file_digest(version_dir / settings.engine_file)}
               if choice.runtime.name == "tensorrt" else {}),
        })
        shared = None
        if settings.redis_url:
            shared = RedisTier(settings.redis_url, dim=settings.embedding_dim,
                               timeout_s=settings.redis_timeout_ms / 1000, retry_s=settings.redis_retry_s,
                               ttl_s=settings.cache_ttl_s, key_prefix=settings.redis_key_prefix, logger=logger,
                               metrics=metrics)
        logger.info(f"row cache: in process {settings.cache_bytes} bytes, shared "
                    f"{shared.url if shared else 'off'}, ttl {settings.cache_ttl_s or 'none'} s; output "
                    f"fingerprint {fingerprint.hex()[:16]} (weights hashed in {time.perf_counter() - start:.2f} s)")
        return cls(settings, choice.runtime, tokenizer, metrics, logger,
                   cache=RowCache(settings.cache_bytes, ttl_s=settings.cache_ttl_s), shared=shared,
                   fingerprint=fingerprint)

    def close(self) -> None:
        """Release what outlives a call: the shared tier's writer and connections."""
        if self.shared is not None:
            self.shared.close()

    def _cost_model(self) -> CostModel:
        if self.settings.cost_model != "auto":
            return CostModel.parse(self.settings.cost_model)
        if self.runtime.name == "bls":
            # BLS runs only inside execute (Triton 2.51), so nothing can be timed at load.
            self.logger.warning(f"cost model: runtime 'bls' cannot be timed at load; using '{BLS_DEFAULT_COST}' "
                                "(a GPU-like pass) until set with parameter cost_model")
            return CostModel.parse(BLS_DEFAULT_COST)
        start = time.perf_counter()
        model, samples = calibrate(self.runtime, max_rows=self.settings.max_batch_rows,
                                   max_tokens=self.settings.max_batch_tokens,
                                   max_length=self.settings.max_sequence_length)
        self.cost_samples = samples
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
            decoded = self.decode(request)
            if isinstance(decoded, CoalesceError):
                results[index] = decoded
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
        computed = np.empty((len(distinct), self.settings.embedding_dim), dtype=np.float32)
        todo, keys = self._answer_from_cache(distinct, computed)  # rows of `distinct` still to compute
        failures: dict[int, CoalesceError] = {}  # distinct row -> the error of its pass
        encoded = self.tokenizer.encode([distinct[i] for i in todo]) if len(todo) else None
        t1 = time.perf_counter()
        stage["tokenize"].observe(t1 - t0)
        # The coalescer plans over the misses alone.
        plans = self.plan(encoded.lengths) if encoded is not None else []
        t2 = time.perf_counter()
        stage["plan"].observe(t2 - t1)

        infer_s = pool_s = 0.0
        done = np.zeros(len(todo), dtype=bool)
        for plan in plans:
            assert encoded is not None
            input_ids, mask, type_ids = encoded.padded(plan.rows, plan.padded_length)
            ta = time.perf_counter()
            try:
                hidden = self.runtime.run(input_ids, mask, type_ids)
            except CoalesceError as exc:
                # Only the requests with rows in this pass fail; the other passes go on.
                self.logger.error(f"forward pass of {len(plan.rows)} rows failed: {exc}")
                failure = as_result(exc)
                for row in plan.rows:
                    failures[int(todo[row])] = failure
                infer_s += time.perf_counter() - ta
                continue
            tb = time.perf_counter()
            for observe in self.pass_observers:
                observe(len(plan.rows), plan.padded_length, tb - ta)
            computed[todo[plan.rows]] = pool(hidden, mask, mode=self.settings.pooling,
                                             normalize=self.settings.normalize)
            done[plan.rows] = True
            infer_s += tb - ta
            pool_s += time.perf_counter() - tb
            metrics.forward_passes.increment(1)
            metrics.real_tokens.increment(plan.real_tokens)
            metrics.padded_tokens.increment(plan.padded_tokens)
            metrics.padding_ratio.observe(plan.padding_ratio)
            metrics.batch_rows.observe(len(plan.rows))
        stage["infer"].observe(infer_s)
        stage["pool"].observe(pool_s)
        if keys and done.any():
            stored = todo[done]
            stored_keys = [keys[i] for i in stored]
            if self.shared is not None:
                self.shared.put_many(stored_keys, computed[stored])  # queued; written off the request path
            if self.cache is not None:
                metrics.cache_evictions.increment(self.cache.put_many(stored_keys, computed[stored]))
                metrics.cache_resident_bytes.set(self.cache.resident_bytes)

        t3 = time.perf_counter()
        # Without duplicates `computed` is already in row order; a gather would only copy it.
        out = computed if len(distinct) == len(texts) else computed[inverse]
        for index, lo, hi in spans:
            bad = [int(d) for d in inverse[lo:hi] if int(d) in failures] if failures else []
            results[index] = failures[bad[0]] if bad else out[lo:hi]
        stage["scatter"].observe(time.perf_counter() - t3)

    def _answer_from_cache(self, distinct: list[str], computed: np.ndarray) -> tuple[np.ndarray, list[bytes]]:
        """Fill ``computed`` with the cached rows; return the indices of the rows still to compute, and the keys."""
        if self.cache is None and self.shared is None:
            return np.arange(len(distinct)), []
        keys = [row_key(self.fingerprint, text) for text in distinct]
        missing = list(range(len(distinct)))
        if self.cache is not None:
            found = self.cache.get_many(keys)
            missing = [i for i, vector in enumerate(found) if vector is None]
            for i, vector in enumerate(found):
                if vector is not None:
                    computed[i] = vector
            self.metrics.cache_hits.increment(len(distinct) - len(missing))
            self.metrics.cache_misses.increment(len(missing))
        if self.shared is not None and missing:
            # One round trip for every row the first tier missed; a shared hit is kept in process too.
            shared = self.shared.get_many([keys[i] for i in missing])
            hits = [i for i, vector in zip(missing, shared, strict=True) if vector is not None]
            for i, vector in zip(missing, shared, strict=True):
                if vector is not None:
                    computed[i] = vector
            if hits and self.cache is not None:
                self.metrics.cache_evictions.increment(self.cache.put_many([keys[i] for i in hits], computed[hits]))
                self.metrics.cache_resident_bytes.set(self.cache.resident_bytes)
            missing = [i for i, vector in zip(missing, shared, strict=True) if vector is None]
        return np.array(missing, dtype=np.intp), keys

    def decode(self, request: RequestInput) -> list[str] | CoalesceError:
        """One request's texts, or the error it is to be answered with."""
        if isinstance(request, CoalesceError):
            return request
        try:
            return self._decode(request)
        except InvalidInputError as exc:
            return as_result(exc)

    def token_lengths(self, texts: Sequence[str]) -> np.ndarray:
        """Token length of each text after truncation (what a pass over it costs)."""
        return self.tokenizer.lengths(texts)

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
