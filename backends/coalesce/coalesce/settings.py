"""The settings of one model, parsed once from ``config.pbtxt`` ``parameters``: one options object per component.

Every key a user may set is declared here with its type, default, bounds and meaning,
in the options class of the component that reads it (the task, the runtime, the
planner, the row cache, the scheduler, the metrics). Unknown keys, bad values and keys
of another task's options make the load fail with a message naming the model, the key
and the value, so a typo never silently falls back to a default.

This module imports nothing of ours: every component imports it, never the reverse.
"""

from __future__ import annotations

import dataclasses
import math
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final

#: The task of causal LMs: a decoupled model served by ``coalesce.generation``'s engine, not a row ``Task``.
GENERATE_TASK: Final = "generate"
#: The tasks a model may declare (parameter ``task``).
TASKS: Final = ("embedding", "classify", "similarity", "tensor", GENERATE_TASK)
#: The tasks whose requests are rows coalesced into forward passes (every task but ``generate``).
ROW_TASKS: Final = ("embedding", "classify", "similarity", "tensor")
#: The tasks whose rows are texts (or text pairs), tokenised with the model's ``tokenizer.json``.
TEXT_TASKS: Final = ("embedding", "classify", "similarity")
#: The tasks whose graph gives token states that INT8 may serve (the accuracy guard compares their embeddings).
INT8_TASKS: Final = ("embedding", "similarity")
GENERATION_BATCHING_CHOICES: Final = ("continuous", "request")
RUNTIME_CHOICES: Final = ("auto", "tensorrt", "onnxruntime", "torch", "bls")
PRECISION_CHOICES: Final = ("fp32", "fp16", "int8", "auto")
POOLING_CHOICES: Final = ("mean", "cls")
ACTIVATION_CHOICES: Final = ("none", "sigmoid", "softmax")
PLANNER_CHOICES: Final = ("dp", "greedy")
SCHEDULING_CHOICES: Final = ("triton", "adaptive")
REDIS_SCHEMES: Final = ("redis://", "rediss://", "unix://")
#: Parameters naming a file or folder of the model's version folder: each must stay inside it.
FILE_PARAMETERS: Final = ("tokenizer_file", "onnx_file", "int8_onnx_file", "engine_file", "torch_model_dir")
#: Per-input parameter of the tensor task: ``pad_value:<input name>``.
PAD_VALUE_PREFIX: Final = "pad_value:"
_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


class SettingsError(ValueError):
    """A parameter is unknown, malformed, out of bounds or inconsistent; the model's load fails with this message."""


def _spec(default: Any, doc: str, *, low: float | None = None, high: float | None = None,
          choices: tuple[str, ...] | None = None) -> Any:
    """Declare a setting: its default, help text and bounds, kept in field metadata."""
    return dataclasses.field(default=default, metadata={"doc": doc, "low": low, "high": high, "choices": choices})


@dataclasses.dataclass(frozen=True)
class TaskOptions:
    """What the model does with its rows (every task).

    Each options class says in ``APPLIES_TO`` which tasks read it (None: every task); a
    parameter of another task's options fails the load.
    """

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = None

    task: str = _spec(
        "embedding", "What the model does: `embedding` (texts to vectors), `classify` (texts or text pairs to "
        "scores: classifiers and cross-encoder rerankers), `similarity` (text pairs to the cosine of their two "
        "embeddings: a bi-encoder scorer), `tensor` (any graph: named tensors in and out, rows on dim 0) or "
        "`generate` (a causal LM: text in, generated text out, streamed; a decoupled model).",
        choices=TASKS)
    max_sequence_length: int = _spec(
        256, "Longest row in positions: text tasks truncate to this many tokens (special tokens included); the "
        "tensor task refuses rows whose variable dim is longer; `generate`: the context, prompt and generated "
        "tokens together (capped by the model's own).", low=1, high=1 << 20)
    max_request_bytes: int = _spec(
        4_194_304, "Largest accepted request in bytes (every input tensor's bytes; for TYPE_STRING inputs, the "
        "sum of their items' lengths), checked before any other work; a larger one gets INVALID_ARG naming the "
        "limit and its size.", low=1, high=1 << 40)


@dataclasses.dataclass(frozen=True)
class TextOptions:
    """Reading and tokenising texts (tasks ``embedding``, ``classify`` and ``similarity``)."""

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = TEXT_TASKS

    tokenizer_file: str = _spec("tokenizer.json", "Hugging Face `tokenizers` file, relative to the version folder.")
    max_text_bytes: int = _spec(1_048_576, "Largest accepted text in bytes; a larger one gets INVALID_ARG.",
                                low=1, high=1 << 30)
    text_bytes_per_token: int = _spec(
        64, "Before tokenising, each text is cut at a UTF-8 boundary after max_sequence_length x this many bytes "
        "(truncation keeps fewer tokens than such a text holds, so the tokenizer never works through the rest); "
        "0: never cut.", low=0, high=1 << 20)


@dataclasses.dataclass(frozen=True)
class EmbeddingOptions:
    """Turning token states into one vector per text (tasks ``embedding`` and ``similarity``)."""

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = ("embedding", "similarity")

    pooling: str = _spec("mean", "Pooling of token states: `mean` over the attention mask, or `cls` (the first "
                         "token's state).", choices=POOLING_CHOICES)
    normalize: bool = _spec(True, "L2-normalise each embedding (task similarity: always, its scores are cosines).")
    matryoshka_dimensions: str = _spec(
        "", "Widths the model was trained to be cut to (Matryoshka), comma-separated, e.g. `256,128,64`: the "
        "gateway's `dimensions` takes only these (and the full width), cutting and re-normalising each vector; "
        "empty: only the full width.")

    @property
    def matryoshka_widths(self) -> tuple[int, ...]:
        """``matryoshka_dimensions`` as numbers.

        Raises:
            ValueError: If an item is not a positive number.
        """
        items = [item.strip() for item in self.matryoshka_dimensions.split(",") if item.strip()]
        if any(not item.isdigit() or int(item) <= 0 for item in items):
            raise ValueError(f"expected positive numbers separated by commas, found {self.matryoshka_dimensions!r}")
        return tuple(int(item) for item in items)


@dataclasses.dataclass(frozen=True)
class ClassifyOptions:
    """Turning logits into scores (task ``classify``)."""

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = ("classify",)

    activation: str = _spec(
        "none", "Applied to each row's logits: `none` (raw logits), `sigmoid` (per label, e.g. a one-label "
        "cross-encoder's relevance) or `softmax` (over the labels).", choices=ACTIVATION_CHOICES)


@dataclasses.dataclass(frozen=True)
class TensorOptions:
    """Padding and masking of variable-length inputs (task ``tensor``).

    ``pad_values`` come from the per-input keys ``pad_value:<input name>``.
    """

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = ("tensor",)

    mask_input: str = _spec(
        "", "Input holding the 0/1 mask of real positions: filled by the backend when a request leaves it out "
        "(declare it `optional: true`), checked and padded with 0 when sent. Empty: no mask.")
    pad_values: Mapping[str, float] = dataclasses.field(default_factory=dict, metadata={
        "doc": "`pad_value:<input>`: value a variable-length input is padded with (default 0).", "dynamic": True})


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """Continuous batching, the KV cache and sampling limits (task ``generate``)."""

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = (GENERATE_TASK,)

    generation_batching: str = _spec(
        "continuous", "`continuous`: every step runs one forward pass over all active sequences, new requests "
        "join at the next step and each leaves the step it finishes; `request`: Triton's batch of requests runs "
        "until its longest generation ends before the next batch starts (static batching, for comparison).",
        choices=GENERATION_BATCHING_CHOICES)
    kv_cache_bytes: int = _spec(
        268_435_456, "Bytes of the preallocated KV-cache pool (keys and values of every layer). A request takes "
        "the blocks its prompt and max_tokens need when it joins; while the pool is full new requests wait.",
        low=1, high=1 << 44)
    kv_block_tokens: int = _spec(16, "Tokens per KV-cache block: the unit of allocation and of prefix reuse.",
                                 low=1, high=4096)
    prefix_cache: bool = _spec(
        True, "Reuse the KV blocks of prompt prefixes already computed (a system prompt, few-shot examples); "
        "blocks no request holds stay cached until the pool needs them (least recently used first).")
    max_active_sequences: int = _spec(64, "Most sequences in one step's forward pass.", low=1, high=65536)
    max_prefill_tokens: int = _spec(
        512, "Most prompt tokens prefilled per step (longer prompts are prefilled in chunks over several "
        "steps), so that running sequences keep getting a token every step.", low=1, high=1 << 20)
    max_waiting_sequences: int = _spec(
        256, "Most requests waiting to join (for room in the KV cache); past it requests get UNAVAILABLE.",
        low=0, high=1 << 20)
    max_queue_wait_ms: float = _spec(
        5000.0, "Most milliseconds a request waits to join; then it gets UNAVAILABLE (the KV cache stayed full).",
        low=0.0, high=3_600_000.0)
    cancel_check_interval_ms: float = _spec(
        100.0, "Each waiting or running request is asked at most this often whether its client cancelled it (in "
        "Triton every ask is a round trip to the server, run beside the steps); a cancelled request leaves, and "
        "frees its KV blocks, within about this plus one step. 0: ask every step.", low=0.0, high=60_000.0)
    default_max_tokens: int = _spec(16, "Tokens generated when a request sets no max_tokens (vLLM's default).",
                                    low=1, high=1 << 20)
    max_tokens_limit: int = _spec(1024, "Largest max_tokens a request may ask; a larger one gets INVALID_ARG.",
                                  low=1, high=1 << 20)
    max_stop_strings: int = _spec(16, "Most stop strings a request may give.", low=0, high=1024)


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """Which engine runs the forward passes, and how (every task)."""

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = None

    runtime: str = _spec(
        "auto", "Inference runtime: `auto` picks the best available (TensorRT engine, ONNX Runtime on the GPU, "
        "torch on CUDA, ONNX Runtime on the CPU) and logs why; `tensorrt`, `onnxruntime`, `torch` or `bls` "
        "force one, and fail the load saying what is missing.", choices=RUNTIME_CHOICES)
    onnx_file: str = _spec("model.onnx", "ONNX graph, relative to the version folder.")
    engine_file: str = _spec("model.plan", "TensorRT engine, relative to the version folder (`coalesce build-engine`).")
    torch_model_dir: str = _spec(
        "hf", "Hugging Face weights folder for the torch runtime (text tasks), relative to the version folder.")
    precision: str = _spec(
        "fp32", "Compute precision: `fp16` for the torch runtime on CUDA (halves memory, uses tensor cores), and for "
        "task `generate` on the CPU fp16 weights computed in float32 (half the bytes each decoding step reads); "
        "`int8` for ONNX Runtime on the CPU (tasks embedding and similarity): runs `int8_onnx_file`, a graph with "
        "8-bit weights (`coalesce export --int8`), and loads only if its vectors pass the accuracy guard against "
        "`onnx_file`; `auto`: `int8` where `coalesce export --int8` found, on this CPU, an INT8 graph that passes "
        "the guard and runs faster than FP32 (its record beside the graph says), else `fp32` (the load logs which "
        "and why). TensorRT engines carry their own. Part of the cache key.", choices=PRECISION_CHOICES)
    int8_onnx_file: str = _spec(
        "model.int8.onnx", "precision `int8`: the quantised ONNX graph, relative to the version folder.")
    int8_min_mean_cosine: float = _spec(
        0.99, "precision `int8`: least mean cosine between the INT8 and FP32 graphs' vectors on the built-in "
        "text set; below it the load fails, giving the numbers.", low=-1.0, high=1.0)
    int8_min_cosine: float = _spec(
        0.98, "precision `int8`: least cosine of any one text of that set (batched or alone); below it the "
        "load fails.", low=-1.0, high=1.0)
    cuda_graphs: bool = _spec(
        False, "torch on CUDA: capture CUDA graphs for fixed (rows, length) buckets and pad passes up to them.")
    bls_model: str = _spec("", "runtime `bls`: the Triton model that runs the graph for each pass.")
    bls_model_version: str = _spec("", "runtime `bls`: version of `bls_model` (empty: the server's policy).")
    intra_op_threads: int = _spec(0, "ONNX Runtime intra-op threads (torch on the CPU: its threads); 0: every core.",
                                  low=0, high=1024)
    inter_op_threads: int = _spec(1, "ONNX Runtime inter-op threads.", low=0, high=1024)
    thread_spinning: bool = _spec(
        True, "ONNX Runtime's threads spin-wait for work between operators and passes (its default); `false` "
        "yields the cores to other processes.")
    share_idle_cores: bool = _spec(
        True, "ONNX Runtime on the CPU with `intra_op_threads` below the cores: a pass runs on every core while no "
        "other model of the server computes, on `intra_op_threads` while one does (the server's models mark a "
        "shared-memory board per pass); the cores go back to a neighbour within one pass. Holds a second session "
        "(the graph's weights twice); task `generate` sets a step's torch threads the same way (no second copy). "
        "`false`: always `intra_op_threads`.")
    borrowed_thread_priority: str = _spec(
        "idle", "`share_idle_cores`: priority of the threads a pass borrows beyond `intra_op_threads`: `idle` "
        "(Linux SCHED_IDLE: they run only on cores no other thread wants, so a neighbour gets its core at once) or "
        "`normal`.", choices=("idle", "normal"))


@dataclasses.dataclass(frozen=True)
class PlannerOptions:
    """How the rows of one dispatch are cut into forward passes (every task)."""

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = ROW_TASKS

    max_batch_rows: int = _spec(64, "Most rows in one forward pass.", low=1, high=65536)
    max_batch_tokens: int = _spec(
        8192, "Most padded positions (rows x padded length) in one forward pass; bounds activation memory.",
        low=1, high=16_777_216)
    planner: str = _spec(
        "dp", "How rows are cut into passes: `dp` picks the cuts of least predicted time under the cost "
        "model; `greedy` fills passes in length order up to the limits and `max_padding_ratio`.",
        choices=PLANNER_CHOICES)
    cost_model: str = _spec(
        "auto", "Predicted seconds of a pass, `a,b,c` in a + b*rows*len + c*rows*len^2; `auto` times the "
        "runtime at load and logs the fit, which can be pasted here to skip calibration.")
    max_padding_ratio: float = _spec(
        1.25, "Greedy planner only: most padded over real positions in one pass; a longer row starts a new pass.",
        low=1.0, high=1000.0)

    @property
    def cost_coefficients(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` of a fixed cost model, or None for ``auto``."""
        return None if self.cost_model == "auto" else parse_cost_model(self.cost_model)


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """The row cache: in process and shared through Redis (every task)."""

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = ROW_TASKS

    cache_bytes: int = _spec(
        0, "Bytes of the in-process row cache (outputs, keys and bookkeeping; LRU eviction); 0 disables it.",
        low=0, high=1 << 40)
    cache_ttl_s: float = _spec(0.0, "Seconds a cached row stays valid (in process and in Redis); 0: until evicted.",
                               low=0.0, high=1e9)
    redis_url: str = _spec(
        "", "Shared row-cache tier: `redis://host:port/db` (or `rediss://`, `unix://`); empty: no shared tier. "
        "`coalesce serve` starts a local redis-server for a loopback URL nobody listens on. No password here: "
        "see the shared tier's secrets.")
    redis_timeout_ms: float = _spec(
        50.0, "Most milliseconds one Redis round trip (connect, lookup or write) may take before the model "
        "serves without it.", low=1.0, high=60_000.0)
    redis_retry_s: float = _spec(
        2.0, "After a Redis error, seconds the model serves without Redis before trying it again.",
        low=0.0, high=3600.0)
    redis_key_prefix: str = _spec("coalesce:", "Prefix of every key this model writes to Redis.")

    @property
    def enabled(self) -> bool:
        """Whether any tier is on (in process or shared)."""
        return self.cache_bytes > 0 or bool(self.redis_url)


@dataclasses.dataclass(frozen=True)
class SchedulerOptions:
    """Who forms batches, and the adaptive scheduler's targets (every task)."""

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = ROW_TASKS

    scheduling: str = _spec(
        "triton", "Who forms batches: `triton` runs each batch Triton's dynamic batcher hands over; `adaptive` "
        "queues every request in the backend and dispatches by deadline and the learned cost model (set "
        "Triton's max_queue_delay_microseconds to 0).", choices=SCHEDULING_CHOICES)
    target_p99_ms: float = _spec(
        200.0, "Adaptive: latency target per request in the backend, in ms; a request's own timeout, when "
        "shorter, wins. Requests that cannot meet it are refused at once with UNAVAILABLE.", low=1.0, high=3_600_000.0)
    max_queue_rows: int = _spec(4096, "Adaptive: most rows queued; past it requests get UNAVAILABLE.",
                                low=1, high=1 << 24)
    max_queue_bytes: int = _spec(
        67_108_864, "Adaptive: most bytes of requests queued (their inputs as sent, see max_request_bytes); "
        "past it requests get UNAVAILABLE.", low=1, high=1 << 40)
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

    @property
    def weights(self) -> dict[str, float]:
        """Parsed ``tenant_weights``."""
        return parse_tenant_map(self.tenant_weights, what="tenant_weights")

    @property
    def rate_limits(self) -> dict[str, float]:
        """Parsed ``tenant_max_rows_per_s``."""
        return parse_tenant_map(self.tenant_max_rows_per_s, what="tenant_max_rows_per_s")


@dataclasses.dataclass(frozen=True)
class MetricsOptions:
    """How the backend's metrics reach Triton's metrics port (every task)."""

    APPLIES_TO: ClassVar[tuple[str, ...] | None] = None

    metrics_interval_ms: float = _spec(
        100.0, "Milliseconds between sends of the backend's metrics to Triton's metrics port. Metrics are "
        "recorded in process and sent by a background thread (each send is a round trip to the server "
        "process); scrapes lag by up to this much.", low=10.0, high=60_000.0)


#: Components in the order ``coalesce settings`` lists them: (attribute of ``ModelSettings``, options class).
COMPONENTS: Final[tuple[tuple[str, type], ...]] = (
    ("task", TaskOptions), ("text", TextOptions), ("embedding", EmbeddingOptions), ("classify", ClassifyOptions),
    ("tensor", TensorOptions), (GENERATE_TASK, GenerateOptions),
    ("runtime", RuntimeOptions), ("planner", PlannerOptions), ("cache", CacheOptions),
    ("scheduler", SchedulerOptions), ("metrics", MetricsOptions))


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """Validated settings of one model: its name, row limit and one options object per component."""

    model_name: str = "model"
    max_batch_size: int = 0
    task: TaskOptions = dataclasses.field(default_factory=TaskOptions)
    text: TextOptions = dataclasses.field(default_factory=TextOptions)
    embedding: EmbeddingOptions = dataclasses.field(default_factory=EmbeddingOptions)
    classify: ClassifyOptions = dataclasses.field(default_factory=ClassifyOptions)
    tensor: TensorOptions = dataclasses.field(default_factory=TensorOptions)
    generate: GenerateOptions = dataclasses.field(default_factory=GenerateOptions)
    runtime: RuntimeOptions = dataclasses.field(default_factory=RuntimeOptions)
    planner: PlannerOptions = dataclasses.field(default_factory=PlannerOptions)
    cache: CacheOptions = dataclasses.field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = dataclasses.field(default_factory=SchedulerOptions)
    metrics: MetricsOptions = dataclasses.field(default_factory=MetricsOptions)

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str], *, model_name: str = "model",
                        max_batch_size: int = 0) -> ModelSettings:
        """Build settings from plain ``key -> string`` parameters.

        Raises:
            SettingsError: On an unknown key, a key of another task's options, a value of the wrong
                type or out of bounds, or inconsistent settings; the message names model, key and value.
        """
        where = f"model '{model_name}'"
        owners = {f.name: (attr, options) for attr, options in COMPONENTS for f in parameter_fields(options)}
        raw_task = parameters.get("task", str(_field(TaskOptions, "task").default))
        task = _convert(where, _field(TaskOptions, "task"), raw_task)
        values: dict[str, dict[str, Any]] = {attr: {} for attr, _ in COMPONENTS}
        pad_values: dict[str, float] = {}
        for key, raw in parameters.items():
            if key.startswith(PAD_VALUE_PREFIX) and key != PAD_VALUE_PREFIX:
                _check_task(where, key, raw, TensorOptions, task)
                pad_values[key[len(PAD_VALUE_PREFIX):]] = _number(where, key, raw)
                continue
            owner = owners.get(key)
            if owner is None:
                raise SettingsError(
                    f"{where}: unknown parameter '{key}' (value '{raw}'); known parameters: "
                    f"{', '.join(sorted(owners))}, {PAD_VALUE_PREFIX}<input>")
            attr, options = owner
            _check_task(where, key, raw, options, task)
            values[attr][key] = _convert(where, _field(options, key), raw)
        if pad_values:
            values["tensor"]["pad_values"] = pad_values
        settings = cls(model_name=model_name, max_batch_size=max_batch_size,
                       **{attr: options(**values[attr]) for attr, options in COMPONENTS})
        settings._check_consistency()
        return settings

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any]) -> ModelSettings:
        """Build settings from a Triton model config (the JSON form of ``config.pbtxt``).

        Raises:
            SettingsError: On any invalid parameter.
        """
        return cls.from_parameters(config_parameters(config), model_name=str(config.get("name", "model")),
                                   max_batch_size=int(config.get("max_batch_size", 0) or 0))

    def changed(self) -> dict[str, Any]:
        """The parameters set to something other than their default, for the load log."""
        out: dict[str, Any] = {}
        for attr, options in COMPONENTS:
            current = getattr(self, attr)
            for f in dataclasses.fields(options):
                value = getattr(current, f.name)
                if f.default is not dataclasses.MISSING:
                    default = f.default
                else:
                    default = f.default_factory() if callable(f.default_factory) else None
                if value != default:
                    out[f.name] = value
        return out

    def _check_consistency(self) -> None:
        where = f"model '{self.model_name}'"
        planner, cache = self.planner, self.cache
        for key in FILE_PARAMETERS:
            value = getattr(self.text if key == "tokenizer_file" else self.runtime, key)
            why = inside_version_folder(value)
            if why:
                raise SettingsError(f"{where}: parameter '{key}' has bad value '{value}': {why}")
        try:
            planner.cost_coefficients  # noqa: B018 - parses it
        except ValueError:
            raise SettingsError(f"{where}: parameter 'cost_model' has bad value '{planner.cost_model}': expected "
                                "'auto' or three non-negative numbers 'a,b,c' (seconds)") from None
        if cache.redis_url and not cache.redis_url.startswith(REDIS_SCHEMES):
            raise SettingsError(f"{where}: parameter 'redis_url' has bad value '{_without_password(cache.redis_url)}'"
                                f": expected a URL starting with {', '.join(REDIS_SCHEMES)}")
        if _has_password(cache.redis_url):
            # config.pbtxt is served back by Triton's config endpoint and printed in the load log.
            raise SettingsError(
                f"{where}: parameter 'redis_url' ('{_without_password(cache.redis_url)}') carries a password; "
                "config.pbtxt is readable through Triton's config endpoint, so take it out and give the password "
                "to the server's environment: COALESCE_REDIS_PASSWORD, or a file named by "
                "COALESCE_REDIS_PASSWORD_FILE")
        try:
            self.embedding.matryoshka_widths  # noqa: B018 - parses it
        except ValueError as exc:
            raise SettingsError(f"{where}: parameter 'matryoshka_dimensions' has bad value "
                                f"'{self.embedding.matryoshka_dimensions}': {exc}") from None
        for key in ("tenant_weights", "tenant_max_rows_per_s"):
            try:
                parse_tenant_map(getattr(self.scheduler, key), what=key)
            except ValueError as exc:
                raise SettingsError(f"{where}: parameter '{key}' has bad value "
                                    f"'{getattr(self.scheduler, key)}': {exc}") from None
        if self.task.task == GENERATE_TASK and self.runtime.runtime not in ("auto", "torch"):
            raise SettingsError(f"{where}: parameter 'runtime' has bad value '{self.runtime.runtime}': task "
                                "'generate' runs on the torch runtime (`auto` or `torch`)")
        if self.runtime.precision == "int8" and (self.task.task not in INT8_TASKS
                                                 or self.runtime.runtime not in ("auto", "onnxruntime")):
            raise SettingsError(
                f"{where}: parameter 'precision' has bad value 'int8': INT8 runs ONNX Runtime on the CPU for tasks "
                f"{' and '.join(repr(t) for t in INT8_TASKS)} (its accuracy guard compares embeddings); this model "
                f"has task '{self.task.task}' and runtime '{self.runtime.runtime}'")
        if self.task.task == "similarity" and not self.embedding.normalize:
            raise SettingsError(
                f"{where}: parameter 'normalize' has bad value 'false': task 'similarity' scores the cosine of two "
                "embeddings, which normalises them; leave 'normalize' out")
        if self.task.task in TEXT_TASKS and planner.max_batch_tokens < self.task.max_sequence_length:
            raise SettingsError(
                f"{where}: parameter 'max_batch_tokens' (value '{planner.max_batch_tokens}') is below "
                f"'max_sequence_length' ({self.task.max_sequence_length}): a single long text could never be "
                "scheduled")


def _has_password(url: str) -> bool:
    """Whether a Redis URL carries a password (``user:pass@`` or a ``password`` query field)."""
    parts = urllib.parse.urlsplit(url)
    return parts.password is not None or "password" in urllib.parse.parse_qs(parts.query)


def _without_password(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        url = url.replace(f":{parts.password}@", ":***@", 1)
    if parts.query:
        query = "&".join("password=***" if field.partition("=")[0] == "password" else field
                         for field in parts.query.split("&"))
        url = url.replace(f"?{parts.query}", f"?{query}", 1)
    return url


def parameter_fields(options: type) -> list[dataclasses.Field[Any]]:
    """The fields of an options class a user sets under ``parameters``, in declaration order."""
    return [f for f in dataclasses.fields(options) if not f.metadata.get("dynamic")]


def config_parameters(config: Mapping[str, Any]) -> dict[str, str]:
    """``parameters`` of a model config (JSON form) as plain strings.

    Triton's JSON form wraps each value as ``{"string_value": "..."}``.
    """
    raw = config.get("parameters") or {}
    return {key: str(value.get("string_value", "")) if isinstance(value, Mapping) else str(value)
            for key, value in raw.items()}


def inside_version_folder(name: str) -> str:
    """Why ``name`` may not name a file of the model's version folder, or ``""`` when it may.

    A relative path without ``..``: parameters can come from a model-load request
    (``POST /v2/repository/models/<m>/load`` with a config), and must not reach files
    outside the model's own folder. A leading slash or backslash, or a drive letter, makes a path absolute.
    """
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or (name[:1].isalpha() and name[1:2] == ":"):
        return "must be relative to the version folder, not an absolute path"
    if ".." in parts:
        return "must stay inside the version folder ('..' is refused)"
    return ""


def parse_cost_model(text: str) -> tuple[float, float, float]:
    """``"a,b,c"`` (seconds) as three non-negative floats.

    Raises:
        ValueError: If it is not three non-negative finite numbers.
    """
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 3 or not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"cost model '{text}' is not three non-negative numbers 'a,b,c' (seconds)")
    return values[0], values[1], values[2]


def parse_tenant_map(text: str, *, what: str) -> dict[str, float]:
    """Parse ``"name:value,name:value"`` into a mapping of positive numbers.

    Raises:
        ValueError: On a malformed entry or a value that is not a positive number; the
            message names ``what`` and the entry.
    """
    out: dict[str, float] = {}
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        name, sep, value = entry.rpartition(":")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not sep or not name or not math.isfinite(number) or number <= 0:
            raise ValueError(f"{what} entry '{entry}' is not 'tenant:positive number'")
        out[name.strip()] = number
    return out


def _field(options: type, name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(options) if f.name == name)


def _check_task(where: str, key: str, raw: str, options: type, task: str) -> None:
    tasks = options.APPLIES_TO  # type: ignore[attr-defined]
    if tasks is not None and task not in tasks:
        names = f" {tasks[0]}" if len(tasks) == 1 else f"s {', '.join(tasks[:-1])} and {tasks[-1]}"
        raise SettingsError(f"{where}: parameter '{key}' (value '{raw}') applies to task{names}, but this model's "
                            f"task is '{task}'")


def _number(where: str, key: str, raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise SettingsError(f"{where}: parameter '{key}' has bad value '{raw}': expected a number")
    return value


def _convert(where: str, field: dataclasses.Field[Any], raw: str) -> Any:
    def fail(why: str) -> SettingsError:
        return SettingsError(f"{where}: parameter '{field.name}' has bad value '{raw}': {why}")

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
    if kind == "float" and not math.isfinite(float(value)):
        raise fail("expected a finite number")
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
