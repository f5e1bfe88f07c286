"""Deterministic runtimes and pipeline builders for unit tests of every task (no Triton, no ONNX Runtime).

Each fake runtime takes and returns named tensors like a real one (``run(feeds, outputs)``,
a ``graph``), computes every row from that row's own real positions only (padding is
ignored through the mask or the row's length), and so any correct coalescing must give
exactly the per-row result. Reductions run over a non-contiguous axis or per row, so a
row's result does not change with the pass it is in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coalesce.batching.costmodel import CostModel
from coalesce.batching.pipeline import Pipeline
from coalesce.cache.memory import RowCache
from coalesce.cache.shared import RedisTier
from coalesce.core.errors import CoalesceError, RuntimeFailure
from coalesce.core.tensors import GraphIO, GraphTensor
from coalesce.observability.metrics import InMemoryMetricFactory, PipelineMetrics
from coalesce.settings import ModelSettings
from coalesce.tasks import create_task
from tests.conftest import built, model_config

#: The example models' hidden width.
DIM = 384
#: A fixed, CPU-like cost model (1 ms a pass, 0.1 ms a position): plans are deterministic.
COST = CostModel(0.001, 0.0001, 0.0)
FINGERPRINT = b"f" * 32
#: Rows of the token table (ids are taken modulo it: distinct enough, and 6 MB instead of 47).
TABLE_ROWS = 4099


@functools.cache
def token_table() -> np.ndarray:
    """A fixed random state per token id (read-only, shared by every fake)."""
    table = np.random.default_rng(0).standard_normal((TABLE_ROWS, DIM)).astype(np.float32)
    table.flags.writeable = False
    return table


def text_graph(output: str, shape: tuple[int | None, ...],
               inputs: Sequence[str] = ("input_ids", "attention_mask", "token_type_ids")) -> GraphIO:
    """What an exported text model's graph reports: int64 token inputs, one float output."""
    return GraphIO(inputs=tuple(GraphTensor(n, "TYPE_INT64", (None, None)) for n in inputs),
                   outputs=(GraphTensor(output, "TYPE_FP32", shape),))


class FakeRuntime:
    """Records every pass (its feeds) and can fail passes on demand; subclasses compute the outputs."""

    name = "fake"
    graph: GraphIO | None = None

    def __init__(self, *, fail_when: Callable[[Mapping[str, np.ndarray]], bool] | None = None) -> None:
        self.feeds: list[dict[str, np.ndarray]] = []
        self.fail_when = fail_when

    @property
    def calls(self) -> list[tuple[int, ...]]:
        """The shape of the first input of every pass: (rows, padded length) for text models."""
        return [next(iter(f.values())).shape for f in self.feeds]

    @property
    def rows_computed(self) -> int:
        return sum(shape[0] for shape in self.calls)

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        self.feeds.append({name: np.array(value, copy=True) for name, value in feeds.items()})
        if self.fail_when is not None and self.fail_when(feeds):
            raise RuntimeFailure(f"injected failure on a pass of shape {list(next(iter(feeds.values())).shape)}")
        computed = self.compute(feeds)
        return {name: computed[name] for name in outputs}

    def compute(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError


def contextual_states(feeds: Mapping[str, np.ndarray]) -> np.ndarray:
    """Token states ``[rows, length, DIM]``: each token's own vector, its type, plus the mean of its row's real tokens.

    The context term makes the first token's state differ per row (as a real encoder's
    [CLS] does), so ``cls`` pooling is tested against something that varies.
    """
    ids = feeds["input_ids"]
    mask = feeds.get("attention_mask")
    mask = np.ones_like(ids) if mask is None else mask
    types = feeds.get("token_type_ids")
    own = token_table()[ids % TABLE_ROWS]
    if types is not None:
        own = own * (1.0 + types[..., None].astype(np.float32))
    weights = mask[..., None].astype(np.float32)
    context = (own * weights).sum(axis=1, keepdims=True) / weights.sum(axis=1, keepdims=True)
    return (own + np.float32(0.5) * context).astype(np.float32)


class EncoderRuntime(FakeRuntime):
    """An encoder: ``last_hidden_state`` of every token (padded positions hold garbage the pooling must skip)."""

    name = "encoder"

    def __init__(self, *, fail_when: Callable[[Mapping[str, np.ndarray]], bool] | None = None,
                 graph: GraphIO | None = None) -> None:
        super().__init__(fail_when=fail_when)
        self.graph = graph if graph is not None else text_graph("last_hidden_state", (None, None, DIM))

    def compute(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = feeds["input_ids"]
        assert ids.dtype == np.int64 and all(v.shape == ids.shape for v in feeds.values())
        return {"last_hidden_state": contextual_states(feeds)}


class ClassifierRuntime(FakeRuntime):
    """A sequence classifier: ``logits [rows, labels]`` from the masked mean of each row's token states."""

    name = "classifier"

    def __init__(self, labels: int = 1, *, fail_when: Callable[[Mapping[str, np.ndarray]], bool] | None = None
                 ) -> None:
        super().__init__(fail_when=fail_when)
        self.labels = labels
        self.weights = np.random.default_rng(1).standard_normal((labels, DIM)).astype(np.float32) / np.float32(8)
        self.graph = text_graph("logits", (None, labels))

    def compute(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        states = contextual_states(feeds)
        weights = feeds["attention_mask"][..., None].astype(np.float32)
        mean = (states * weights).sum(axis=1) / weights.sum(axis=1)
        # Per row and label, summed over the contiguous last axis: independent of the pass's row count.
        return {"logits": (mean[:, None, :] * self.weights[None, :, :]).sum(axis=-1).astype(np.float32)}


def texts(*values: str | bytes) -> np.ndarray:
    """A ``[N, 1]`` BYTES tensor, as Triton hands the backend a request's texts."""
    array = np.empty((len(values), 1), dtype=np.object_)
    array[:, 0] = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
    return array


#: A pipeline's metrics and the in-memory factory that records them.
Recorded = tuple[PipelineMetrics, InMemoryMetricFactory]


def metrics() -> Recorded:
    factory = InMemoryMetricFactory()
    return PipelineMetrics(factory, model="m", version="1"), factory


def make_pipeline(config: Mapping[str, Any], version_dir: Path | None, runtime: Any, *,
                  cache: RowCache | None = None, shared: RedisTier | None = None,
                  pipeline_metrics: Recorded | None = None,
                  cost_model: CostModel | None = None) -> tuple[Pipeline, InMemoryMetricFactory]:
    """A pipeline over the real task of ``config`` (bound to ``runtime``'s graph) and ``runtime``.

    Its cost model is ``cost_model``, else the config's fixed one, else ``COST`` (never calibrated).
    """
    settings = ModelSettings.from_model_config(config)
    fixed = settings.planner.cost_coefficients
    cost_model = cost_model or (CostModel(*fixed) if fixed is not None else COST)
    task = create_task(settings, config, version_dir or Path("/nonexistent"))
    task.bind(runtime.graph)
    recorded, factory = pipeline_metrics or metrics()
    cached = cache is not None or shared is not None
    pipeline = Pipeline(task, runtime, settings.planner, recorded, cost_model=cost_model, cache=cache,
                        shared=shared, fingerprint=FINGERPRINT if cached else b"", model_name=settings.model_name,
                        max_request_bytes=settings.task.max_request_bytes)
    return pipeline, factory


def embedding_pipeline(runtime: Any = None, *, cache: RowCache | None = None, shared: RedisTier | None = None,
                       pipeline_metrics: Recorded | None = None, **parameters: Any
                       ) -> tuple[Pipeline, InMemoryMetricFactory]:
    """The ``minilm`` example model's embedding task (its real tokenizer) over a fake encoder."""
    return make_pipeline(model_config("minilm", **parameters), built("minilm"), runtime or EncoderRuntime(),
                         cache=cache, shared=shared, pipeline_metrics=pipeline_metrics)


def classify_pipeline(runtime: Any = None, *, cache: RowCache | None = None, shared: RedisTier | None = None,
                      pipeline_metrics: Recorded | None = None, **parameters: Any
                      ) -> tuple[Pipeline, InMemoryMetricFactory]:
    """The ``minilm_cross_encoder`` test model's classify task (pairs, sigmoid) over a fake classifier."""
    return make_pipeline(model_config("minilm_cross_encoder", **parameters), built("minilm_cross_encoder"),
                         runtime or ClassifierRuntime(), cache=cache, shared=shared, pipeline_metrics=pipeline_metrics)


def similarity_pipeline(runtime: Any = None, *, cache: RowCache | None = None, shared: RedisTier | None = None,
                        **parameters: Any) -> tuple[Pipeline, InMemoryMetricFactory]:
    """The ``minilm_rerank`` example model's similarity task (pairs, cosine) over a fake encoder."""
    return make_pipeline(model_config("minilm_rerank", **parameters), built("minilm_rerank"),
                         runtime or EncoderRuntime(), cache=cache, shared=shared)


def tokens_pipeline(runtime: Any = None, *, cache: RowCache | None = None, shared: RedisTier | None = None,
                    **parameters: Any) -> tuple[Pipeline, InMemoryMetricFactory]:
    """The ``minilm_tokens`` example model's tensor task (ragged token ids, optional mask) over a fake encoder."""
    return make_pipeline(model_config("minilm_tokens", **parameters), None, runtime or EncoderRuntime(),
                         cache=cache, shared=shared)


#: A tensor model of two outputs, one following the row's length: ``x [-1, 3]`` (padded with -7), an optional
#: ``mask [-1]``, a fixed ``scale [2]``; ``y [-1, 3]`` per position and ``total [2]`` (FP64) per row.
RAGGED_CONFIG: dict[str, Any] = {
    "name": "ragged", "backend": "coalesce", "max_batch_size": 16,
    "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": ["-1", "3"]},
              {"name": "mask", "data_type": "TYPE_INT64", "dims": ["-1"], "optional": True},
              {"name": "scale", "data_type": "TYPE_FP32", "dims": ["2"]}],
    "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": ["-1", "3"]},
               {"name": "total", "data_type": "TYPE_FP64", "dims": ["2"]}],
    "parameters": {"task": {"string_value": "tensor"}, "mask_input": {"string_value": "mask"},
                   "pad_value:x": {"string_value": "-7"}, "max_sequence_length": {"string_value": "32"}},
}


class RaggedRuntime(FakeRuntime):
    """The graph of ``RAGGED_CONFIG``: ``y = x * scale[0] + scale[1]`` per position; ``total``: masked sum, length."""

    name = "ragged"
    graph = GraphIO(
        inputs=(GraphTensor("x", "TYPE_FP32", (None, None, 3)), GraphTensor("mask", "TYPE_INT64", (None, None)),
                GraphTensor("scale", "TYPE_FP32", (None, 2))),
        outputs=(GraphTensor("y", "TYPE_FP32", (None, None, 3)), GraphTensor("total", "TYPE_FP64", (None, 2))))

    def compute(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        x, mask, scale = feeds["x"], feeds["mask"], feeds["scale"]
        y = x * scale[:, None, 0:1] + scale[:, None, 1:2]
        weights = mask[..., None].astype(np.float64)
        total = np.stack([(x.astype(np.float64) * weights).sum(axis=1).sum(axis=-1), mask.sum(axis=1)], axis=1)
        return {"y": y.astype(np.float32), "total": total.astype(np.float64)}


def ragged_pipeline(runtime: Any = None, *, cache: RowCache | None = None, shared: RedisTier | None = None,
                    pipeline_metrics: Recorded | None = None) -> tuple[Pipeline, InMemoryMetricFactory]:
    """A pipeline of ``RAGGED_CONFIG`` over ``RaggedRuntime``."""
    return make_pipeline(RAGGED_CONFIG, None, runtime or RaggedRuntime(), cache=cache, shared=shared,
                         pipeline_metrics=pipeline_metrics)


def ragged_request(rows: int, length: int, seed: int, *, mask: bool = False) -> dict[str, np.ndarray]:
    """A request of ``rows`` rows of ``length`` positions for ``RAGGED_CONFIG``."""
    rng = np.random.default_rng(seed)
    request = {"x": rng.standard_normal((rows, length, 3)).astype(np.float32),
               "scale": rng.standard_normal((rows, 2)).astype(np.float32)}
    if mask:
        request["mask"] = np.ones((rows, length), dtype=np.int64)
    return request


def answers(pipeline: Pipeline, *requests: Mapping[str, np.ndarray] | CoalesceError) -> list[Any]:
    """What ``execute`` gets back for these requests (their tensors by name): read, then run together."""
    return pipeline.run(pipeline.read_all(list(requests)))


class ListSink:
    """A log sink (``pb_utils.Logger``'s shape) that keeps every line with its level."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def log_info(self, message: str) -> None:
        self.lines.append(("info", message))

    def log_warn(self, message: str) -> None:
        self.lines.append(("warn", message))

    def log_error(self, message: str) -> None:
        self.lines.append(("error", message))

    def log_verbose(self, message: str) -> None:
        self.lines.append(("verbose", message))
