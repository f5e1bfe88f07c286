"""The backend's one typed settings object, parsed once from ``config.pbtxt``.

Every key under ``parameters`` is declared here with its type, default, bounds and
meaning. Unknown keys and bad values make the model load fail with a message that
names the model, the key and the value, so a typo never silently falls back to a
default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Final

from coalesce import contract
from coalesce.errors import ConfigError

RUNTIME_CHOICES: Final = ("auto", "tensorrt", "onnxruntime", "torch", "bls")
PRECISION_CHOICES: Final = ("fp32", "fp16")
POOLING_CHOICES: Final = ("mean", "cls")
PLANNER_CHOICES: Final = ("dp", "greedy")
SCHEDULING_CHOICES: Final = ("triton", "adaptive")
REDIS_SCHEMES: Final = ("redis://", "rediss://", "unix://")
_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


def _spec(default: Any, doc: str, *, low: float | None = None, high: float | None = None,
          choices: tuple[str, ...] | None = None) -> Any:
    """Declare a setting: its default, help text and bounds, kept in field metadata."""
    return dataclasses.field(
        default=default, metadata={"doc": doc, "low": low, "high": high, "choices": choices}
    )


@dataclasses.dataclass(frozen=True)
class Settings:
    """Validated backend settings of one model (``config.pbtxt`` ``parameters``).

    Attributes are documented by their ``doc`` metadata, which ``coalesce settings``
    prints and the README reproduces.
    """

    runtime: str = _spec(
        "auto", "Inference runtime: `auto` picks the best available (TensorRT engine, ONNX Runtime on the GPU, "
        "torch on CUDA, ONNX Runtime on the CPU) and logs why; `tensorrt`, `onnxruntime`, `torch` or `bls` "
        "force one, and fail the load saying what is missing.", choices=RUNTIME_CHOICES)
    engine_file: str = _spec("model.plan", "TensorRT engine, relative to the version folder (`coalesce build-engine`).")
    torch_model_dir: str = _spec(
        "hf", "Hugging Face weights folder for the torch runtime, relative to the version folder (`coalesce export`).")
    precision: str = _spec(
        "fp32", "Compute precision of the torch runtime on CUDA (`fp16` halves memory and doubles tensor-core "
        "throughput); TensorRT engines carry their own (see the JSON beside the plan).", choices=PRECISION_CHOICES)
    cuda_graphs: bool = _spec(
        False, "torch on CUDA: capture CUDA graphs for fixed (rows, length) buckets and pad passes up to them.")
    bls_model: str = _spec("", "runtime `bls`: the Triton model that runs the encoder graph for each pass.")
    bls_model_version: str = _spec("", "runtime `bls`: version of `bls_model` (empty: the server's policy).")
    onnx_file: str = _spec("model.onnx", "ONNX graph, relative to the model's version folder.")
    tokenizer_file: str = _spec("tokenizer.json", "Hugging Face `tokenizers` file, relative to the version folder.")
    max_sequence_length: int = _spec(
        256, "Tokens per text after truncation, special tokens included (all-MiniLM-L6-v2: 256).",
        low=2, high=512)
    max_batch_rows: int = _spec(64, "Most rows in one forward pass.", low=1, high=65536)
    max_batch_tokens: int = _spec(
        8192, "Most padded tokens (rows x padded length) in one forward pass; bounds activation memory.",
        low=2, high=16_777_216)
    planner: str = _spec(
        "dp", "How rows are cut into passes: `dp` picks the cuts of least predicted time under the cost "
        "model; `greedy` fills passes in length order up to the limits and `max_padding_ratio`.",
        choices=PLANNER_CHOICES)
    cost_model: str = _spec(
        "auto", "Predicted seconds of a pass, `a,b,c` in a + b*rows*len + c*rows*len^2; `auto` times the "
        "runtime at load and fits it.")
    max_padding_ratio: float = _spec(
        1.25, "Greedy planner only: most padded over real tokens in one pass; a longer row starts a new pass.",
        low=1.0, high=1000.0)
    intra_op_threads: int = _spec(0, "ONNX Runtime intra-op threads; 0 lets ONNX Runtime use every core.",
                                  low=0, high=1024)
    inter_op_threads: int = _spec(1, "ONNX Runtime inter-op threads.", low=0, high=1024)
    thread_spinning: bool = _spec(
        True, "ONNX Runtime's intra-op threads spin-wait for work between operators and passes (its default).")
    max_text_bytes: int = _spec(
        1_048_576, "Largest accepted text in bytes; a larger one is rejected with INVALID_ARG.",
        low=1, high=1 << 30)
    cache_bytes: int = _spec(
        0, "Bytes of the in-process row cache (vectors, keys and bookkeeping; LRU eviction); 0 disables it.",
        low=0, high=1 << 40)
    cache_ttl_s: float = _spec(0.0, "Seconds a cached row stays valid (in process and in Redis); 0: until evicted.",
                               low=0.0, high=1e9)
    redis_url: str = _spec(
        "", "Shared row-cache tier: `redis://host:port/db` (or `rediss://`, `unix://`); empty: no shared tier. "
        "`coalesce serve` starts a local redis-server for a loopback URL nobody listens on.")
    redis_timeout_ms: float = _spec(
        50.0, "Most milliseconds one Redis round trip (connect, lookup or write) may take before the model "
        "serves without it.", low=1.0, high=60_000.0)
    redis_retry_s: float = _spec(
        2.0, "After a Redis error, seconds the model serves without Redis before trying it again.",
        low=0.0, high=3600.0)
    redis_key_prefix: str = _spec("coalesce:", "Prefix of every key this model writes to Redis.")
    scheduling: str = _spec(
        "triton", "Who forms batches: `triton` runs each batch Triton's dynamic batcher hands over; `adaptive` "
        "queues every request in the backend and dispatches by deadline and the learned cost model (set "
        "Triton's max_queue_delay_microseconds to 0).", choices=SCHEDULING_CHOICES)
    target_p99_ms: float = _spec(
        200.0, "Adaptive: latency target per request in the backend, in ms; a request's own timeout, when "
        "shorter, wins. Requests that cannot meet it are refused at once with UNAVAILABLE.", low=1.0, high=3_600_000.0)
    max_queue_rows: int = _spec(4096, "Adaptive: most rows queued; past it requests get UNAVAILABLE.",
                                low=1, high=1 << 24)
    max_dispatch_rows: int = _spec(
        64, "Adaptive: most rows the scheduler runs together (the planner still cuts them into passes of at "
        "most max_batch_rows).", low=1, high=65536)
    tenant_weights: str = _spec(
        "", "Adaptive: fair-queuing weights `tenant:weight,...` (request parameter `tenant`); unlisted tenants "
        "weigh 1.")
    tenant_max_rows_per_s: str = _spec(
        "", "Adaptive: row-rate limits `tenant:rows_per_s,...`; a tenant over its limit gets UNAVAILABLE.")
    default_priority: int = _spec(
        1, "Adaptive: priority level of requests that set none (Triton's convention: 1 is the highest).",
        low=1, high=1_000_000)
    metrics_interval_ms: float = _spec(
        100.0, "Milliseconds between sends of the backend's metrics to Triton's metrics port. Metrics are "
        "recorded in process and sent by a background thread (each send is a round trip to the server "
        "process); scrapes lag by up to this much. Short intervals spread the sends out (at 1000 ms the "
        "burst of sends each second showed in the adaptive scheduler's p99).", low=10.0, high=60_000.0)
    pooling: str = _spec("mean", "Pooling of token states: `mean` over the attention mask, or `cls`.",
                         choices=POOLING_CHOICES)
    normalize: bool = _spec(True, "L2-normalise each embedding.")

    # Derived from the rest of the model config, not from `parameters`.
    model_name: str = dataclasses.field(default="model", metadata={"derived": True})
    max_batch_size: int = dataclasses.field(default=0, metadata={"derived": True})
    embedding_dim: int = dataclasses.field(default=384, metadata={"derived": True})

    @property
    def caches_rows(self) -> bool:
        """Whether any row-cache tier is on (in process or shared)."""
        return self.cache_bytes > 0 or bool(self.redis_url)

    @classmethod
    def parameter_fields(cls) -> list[dataclasses.Field[Any]]:
        """The fields a user may set under ``parameters``, in declaration order."""
        return [f for f in dataclasses.fields(cls) if not f.metadata.get("derived")]

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str], *, model_name: str = "model",
                        **derived: Any) -> Settings:
        """Build settings from plain ``key -> string`` parameters.

        Args:
            parameters: Parameter values as strings, as Triton stores them.
            model_name: Name used in error messages.
            **derived: Values taken from the rest of the model config.

        Raises:
            ConfigError: On an unknown key, a value of the wrong type or out of bounds,
                or inconsistent settings; the message names model, key and value.
        """
        fields = {f.name: f for f in cls.parameter_fields()}
        values: dict[str, Any] = {}
        for key, raw in parameters.items():
            field = fields.get(key)
            if field is None:
                raise ConfigError(
                    f"model '{model_name}': unknown parameter '{key}' (value '{raw}'); "
                    f"known parameters: {', '.join(sorted(fields))}")
            values[key] = _convert(model_name, field, raw)
        settings = cls(model_name=model_name, **values, **derived)
        settings._check_consistency()
        return settings

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any]) -> Settings:
        """Build settings from a Triton model config (the JSON form of ``config.pbtxt``).

        Checks the declared inputs and outputs against the task's contract too.

        Raises:
            ConfigError: On any invalid parameter or a config that breaks the contract.
        """
        name = str(config.get("name", "model"))
        raw_params = config.get("parameters") or {}
        parameters: dict[str, str] = {}
        for key, value in raw_params.items():
            # Triton's JSON form wraps each value as {"string_value": "..."}.
            parameters[key] = str(value.get("string_value", "")) if isinstance(value, Mapping) else str(value)
        embedding_dim = _check_io(name, config)
        return cls.from_parameters(
            parameters, model_name=name, max_batch_size=int(config.get("max_batch_size", 0)),
            embedding_dim=embedding_dim)

    def _check_consistency(self) -> None:
        if self.cost_model != "auto":
            from coalesce.costmodel import CostModel

            try:
                CostModel.parse(self.cost_model)
            except ConfigError:
                raise ConfigError(f"model '{self.model_name}': parameter 'cost_model' has bad value "
                                  f"'{self.cost_model}': expected 'auto' or three non-negative numbers "
                                  "'a,b,c' (seconds)") from None
        if self.redis_url and not self.redis_url.startswith(REDIS_SCHEMES):
            raise ConfigError(f"model '{self.model_name}': parameter 'redis_url' has bad value '{self.redis_url}': "
                              f"expected a URL starting with {', '.join(REDIS_SCHEMES)}")
        from coalesce.scheduler import parse_tenant_map

        for key in ("tenant_weights", "tenant_max_rows_per_s"):
            try:
                parse_tenant_map(getattr(self, key), what=key)
            except ValueError as exc:
                raise ConfigError(f"model '{self.model_name}': parameter '{key}' has bad value "
                                  f"'{getattr(self, key)}': {exc}") from None
        if self.max_batch_tokens < self.max_sequence_length:
            raise ConfigError(
                f"model '{self.model_name}': parameter 'max_batch_tokens' (value '{self.max_batch_tokens}') "
                f"is below 'max_sequence_length' ({self.max_sequence_length}): a single long text "
                "could never be scheduled")


def _convert(model_name: str, field: dataclasses.Field[Any], raw: str) -> Any:
    def fail(why: str) -> ConfigError:
        return ConfigError(f"model '{model_name}': parameter '{field.name}' has bad value '{raw}': {why}")

    text = raw.strip()
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    converter: Callable[[str], Any]
    if kind == "bool":
        lowered = text.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise fail("expected true or false")
    if kind == "int":
        converter = int
    elif kind == "float":
        converter = float
    else:
        converter = str
    try:
        value = converter(text)
    except ValueError:
        raise fail(f"expected {'an integer' if kind == 'int' else 'a number'}") from None
    meta = field.metadata
    if meta["choices"] is not None and value not in meta["choices"]:
        raise fail(f"expected one of {', '.join(meta['choices'])}")
    if kind == "str" and not value and field.default != "":  # an empty default means "off" may be written
        raise fail("must not be empty")
    if meta["low"] is not None and value < meta["low"]:
        raise fail(f"must be >= {meta['low']:g}")
    if meta["high"] is not None and value > meta["high"]:
        raise fail(f"must be <= {meta['high']:g}")
    return value


def _only_tensor(model_name: str, config: Mapping[str, Any], kind: str, name: str,
                 data_type: str) -> Mapping[str, Any]:
    """The single ``kind`` ("input"/"output") tensor ``name`` of the config, with its data type checked."""
    tensors = {t.get("name"): t for t in config.get(kind, [])}
    tensor = tensors.get(name)
    if tensor is None or len(tensors) != 1:
        raise ConfigError(f"model '{model_name}': expected exactly one {kind} '{name}', "
                          f"found {sorted(k for k in tensors if k)}")
    if tensor.get("data_type") != data_type:
        raise ConfigError(f"model '{model_name}': {kind} '{name}' has data_type "
                          f"'{tensor.get('data_type')}', expected '{data_type}'")
    return tensor


def _check_io(model_name: str, config: Mapping[str, Any]) -> int:
    """Check inputs/outputs against the embedding contract; return the embedding width."""
    text = _only_tensor(model_name, config, "input", contract.INPUT_TEXT, contract.INPUT_TEXT_DATATYPE)
    if tuple(int(d) for d in text.get("dims", [])) != contract.INPUT_TEXT_DIMS:
        raise ConfigError(
            f"model '{model_name}': input '{contract.INPUT_TEXT}' has dims {text.get('dims')}, "
            f"expected {list(contract.INPUT_TEXT_DIMS)}")
    emb = _only_tensor(model_name, config, "output", contract.OUTPUT_EMBEDDING, contract.OUTPUT_EMBEDDING_DATATYPE)
    dims = [int(d) for d in emb.get("dims", [])]
    if len(dims) != 1 or dims[0] <= 0:
        raise ConfigError(
            f"model '{model_name}': output '{contract.OUTPUT_EMBEDDING}' has dims {dims}, "
            "expected one positive width such as [384]")
    if int(config.get("max_batch_size", 0)) <= 0:
        raise ConfigError(
            f"model '{model_name}': max_batch_size is {config.get('max_batch_size', 0)}; "
            "the coalesce backend needs batching (max_batch_size >= 1)")
    return dims[0]
