"""Loading a model: its settings, task, runtime, cost model and caches, wired into one pipeline.

Also config auto-completion: what a minimal ``config.pbtxt`` leaves out (inputs and
outputs, from the task and the version's ONNX graph; a row limit) is filled in before
Triton checks the config, so ``backend``, ``max_batch_size`` and ``task`` are enough.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from coalesce.batching.costmodel import CostModel, calibrate
from coalesce.batching.pipeline import Pipeline
from coalesce.cache.keys import file_digest, output_fingerprint
from coalesce.cache.memory import RowCache
from coalesce.cache.secrets import read_secrets
from coalesce.cache.shared import RedisTier
from coalesce.core.errors import ConfigError
from coalesce.core.task import Task, version_file
from coalesce.core.tensors import GraphIO, TensorSpec
from coalesce.observability.log import Logger
from coalesce.observability.metrics import InMemoryMetricFactory, MetricFactory, PipelineMetrics
from coalesce.runtimes import Runtime, create_runtime
from coalesce.runtimes.bls import BlsCall
from coalesce.settings import GENERATE_TASK, INT8_TASKS, ModelSettings, SettingsError
from coalesce.tasks import create_task, task_type

#: Cost model of a BLS target when none is configured: 3 ms a pass, 2 us a position (a GPU encoder's order).
BLS_DEFAULT_COST: Final = "0.003,0.000002,0"
#: ``max_batch_size`` auto-completion gives a model that declares none (the backend needs batching).
DEFAULT_MAX_BATCH_SIZE: Final = 64


def load_pipeline(config: Mapping[str, Any], version_dir: Path, *, version: str = "1",
                  settings: ModelSettings | None = None, metric_factory: MetricFactory | None = None,
                  logger: Logger | None = None, instance_kind: str = "CPU", device_id: int = 0,
                  bls_call: BlsCall | None = None) -> Pipeline:
    """Build a model's pipeline from its config (JSON form) and version folder.

    ``instance_kind`` and ``device_id`` are the Triton instance's; ``bls_call`` lets the
    ``bls`` runtime send passes to another Triton model.

    Raises:
        ConfigError: If a setting, the config's tensors, a file or the runtime does not fit the task;
            the message names the model and what to change.
    """
    settings = settings or read_settings(config)
    name = settings.model_name
    logger = logger or Logger(name)
    settings = resolve_precision(settings, version_dir, logger, instance_kind=instance_kind)
    if settings.max_batch_size <= 0:
        raise ConfigError(f"model '{name}': max_batch_size is {settings.max_batch_size}; the coalesce backend "
                          "needs batching (max_batch_size >= 1): rows are dim 0 of every tensor")
    task = create_task(settings, config, version_dir)
    choice = create_runtime(settings, task, version_dir, instance_kind=instance_kind, device_id=device_id,
                            bls_call=bls_call)
    logger.info(choice.reason)
    task.bind(choice.runtime.graph)
    if settings.runtime.precision == "int8":
        logger.info(check_int8(settings, task, choice.runtime, version_dir))
    metrics = PipelineMetrics(metric_factory or InMemoryMetricFactory(), model=name, version=version)
    cost_model, samples = _cost_model(settings, task, choice.runtime, logger)
    board = None
    if settings.runtime.share_idle_cores and choice.runtime.name == "onnxruntime":
        # After calibration and the INT8 guard: both time and compare the instance's own share.
        from coalesce.runtimes.cores import machine_cores, open_board
        from coalesce.runtimes.onnx import OnnxRuntime

        assert isinstance(choice.runtime, OnnxRuntime)
        board = open_board(settings.runtime.intra_op_threads or machine_cores(), logger.warning)
        if board is not None:
            logger.info(choice.runtime.share_cores(board, settings.runtime.borrowed_thread_priority,
                                                   wide_passes=metrics.wide_passes))
            board = choice.runtime.board  # None where it does not share (not on the CPU)
    cache_options = settings.cache
    if not cache_options.enabled:
        return Pipeline(task, choice.runtime, settings.planner, metrics, logger, cost_model=cost_model,
                        cost_samples=samples, model_name=name, max_request_bytes=settings.task.max_request_bytes,
                        board=board)
    start = time.perf_counter()
    fingerprint = output_fingerprint({
        "model": name, "version": version, **task.fingerprint(),
        **runtime_fingerprint(settings, choice.runtime, version_dir)})
    shared = None
    signing = ""
    if cache_options.redis_url:
        secrets = read_secrets(fingerprint, os.environ)
        shared = RedisTier(cache_options.redis_url, timeout_s=cache_options.redis_timeout_ms / 1000,
                           retry_s=cache_options.redis_retry_s, mac_secret=secrets.mac_secret,
                           ttl_s=cache_options.cache_ttl_s, key_prefix=cache_options.redis_key_prefix,
                           password=secrets.password, ca_file=secrets.ca_file, logger=logger, metrics=metrics)
        signing = (f" (values signed with a key from {secrets.mac_source}; password "
                   f"{'set' if secrets.password else 'none'}; CA {secrets.ca_file or 'system'})")
    logger.info(f"row cache: in process {cache_options.cache_bytes} bytes, shared "
                f"{shared.url if shared else 'off'}{signing}, ttl {cache_options.cache_ttl_s or 'none'} s; output "
                f"fingerprint {fingerprint.hex()[:16]} (files hashed in {time.perf_counter() - start:.2f} s)")
    return Pipeline(task, choice.runtime, settings.planner, metrics, logger, cost_model=cost_model,
                    cost_samples=samples, cache=RowCache(cache_options.cache_bytes, ttl_s=cache_options.cache_ttl_s),
                    shared=shared, fingerprint=fingerprint, model_name=name,
                    max_request_bytes=settings.task.max_request_bytes, board=board)


def resolve_precision(settings: ModelSettings, version_dir: Path, logger: Logger, *,
                      instance_kind: str = "CPU") -> ModelSettings:
    """``settings`` with precision ``auto`` made concrete: ``int8`` where the INT8 graph pays here, else ``fp32``.

    Only a CPU instance of an INT8 task on ONNX Runtime can take ``int8``; the choice and its
    reason go to the log.
    """
    options = settings.runtime
    if options.precision != "auto":
        return settings
    if settings.task.task not in INT8_TASKS or options.runtime not in ("auto", "onnxruntime"):
        pays, why = False, f"INT8 is for tasks {' and '.join(INT8_TASKS)} on ONNX Runtime"
    elif instance_kind.upper() != "CPU":
        pays, why = False, "INT8 runs on the CPU and this is a GPU instance"
    else:
        from coalesce.runtimes.quantized import int8_pays

        pays, why = int8_pays(version_file(version_dir, options.int8_onnx_file))
    chosen = "int8" if pays else "fp32"
    logger.info(f"precision auto: {chosen}: {why}")
    return dataclasses.replace(settings, runtime=dataclasses.replace(options, precision=chosen))


def read_settings(config: Mapping[str, Any]) -> ModelSettings:
    """The model's settings; a settings error becomes the ``ConfigError`` that fails the load.

    Raises:
        ConfigError: With the settings' message (model, key, value).
    """
    try:
        return ModelSettings.from_model_config(config)
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None


def runtime_fingerprint(settings: ModelSettings, runtime: Runtime, version_dir: Path) -> dict[str, Any]:
    """What of the runtime decides the outputs: which one, its precision and the content of the files it runs."""
    options = settings.runtime
    int8 = runtime.name == "onnxruntime" and options.precision == "int8"
    fields: dict[str, Any] = {"runtime": runtime.name,
                              "precision": options.precision if runtime.name == "torch" or int8 else "fp32"}
    if runtime.name == "onnxruntime":
        fields["onnx_sha256"] = file_digest(version_file(version_dir,
                                                         options.int8_onnx_file if int8 else options.onnx_file))
    elif runtime.name == "tensorrt":
        fields["engine_sha256"] = file_digest(version_file(version_dir, options.engine_file))
    elif runtime.name == "torch":
        fields["torch_sha256"] = file_digest(version_file(version_dir, options.torch_model_dir))
    elif runtime.name == "bls":
        fields["bls_model"] = f"{options.bls_model}:{options.bls_model_version}"
    return fields


def check_int8(settings: ModelSettings, task: Task, runtime: Runtime, version_dir: Path) -> str:
    """Compare the INT8 graph's vectors with the FP32 graph's on the built-in text set; the log line if they agree.

    Raises:
        ConfigError: If the mean or the minimum cosine is under its setting (the message gives the numbers),
            or the FP32 graph to compare with is missing.
    """
    from coalesce.runtimes.onnx import OnnxRuntime
    from coalesce.runtimes.quantized import agreement

    options = settings.runtime
    start = time.perf_counter()
    reference = OnnxRuntime.from_options(version_file(version_dir, options.onnx_file), options)
    found = agreement(task, reference.run, runtime.run)
    del reference  # the FP32 session's memory is not kept
    thresholds = (f"needs mean >= {options.int8_min_mean_cosine}, minimum >= {options.int8_min_cosine} "
                  "(settings int8_min_mean_cosine, int8_min_cosine)")
    if not found.passes(options.int8_min_mean_cosine, options.int8_min_cosine):
        raise ConfigError(f"model '{settings.model_name}': the INT8 graph {options.int8_onnx_file} is too far from "
                          f"the FP32 graph {options.onnx_file}: {found.describe()}; {thresholds}. Set precision "
                          "fp32, or re-quantise (`coalesce export --int8` tries smaller blocks until it passes)")
    return (f"INT8 accuracy guard passed in {time.perf_counter() - start:.2f} s: {found.describe()} against "
            f"{options.onnx_file}; {thresholds}")


def _cost_model(settings: ModelSettings, task: Task, runtime: Runtime,
                logger: Logger) -> tuple[CostModel, list[tuple[int, int, float]]]:
    planner = settings.planner
    if planner.cost_coefficients is not None:
        return CostModel(*planner.cost_coefficients), []
    if runtime.name == "bls":
        # BLS runs only inside execute (Triton 2.51), so nothing can be timed at load.
        logger.warning(f"cost model: runtime 'bls' cannot be timed at load; using '{BLS_DEFAULT_COST}' "
                       "(a GPU-like pass) until set with parameter cost_model")
        return CostModel.parse(BLS_DEFAULT_COST), []
    start = time.perf_counter()
    model, samples = calibrate(runtime, task, max_rows=planner.max_batch_rows, max_tokens=planner.max_batch_tokens)
    logger.info(f"cost model calibrated in {time.perf_counter() - start:.2f} s: a,b,c = {model} (set parameter "
                f"cost_model to '{model}' to skip calibration); samples (rows, len, s): "
                + ", ".join(f"({r}, {n}, {s:.4f})" for r, n, s in samples))
    return model, samples


@dataclasses.dataclass(frozen=True)
class Completion:
    """What auto-completion adds to a model config."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int | None
    notes: list[str]
    #: The model streams (task ``generate``): decoupled, and no dynamic batching unless the config asks for it.
    decoupled: bool = False


def complete_config(config: Mapping[str, Any], version_dir: Path | None) -> Completion:
    """What a config leaves out that the task and the version's ONNX graph can say.

    Never fails for what is missing (the load then says what is wrong, with the model's
    name); invalid parameters, or a graph the task cannot feed, fail at once.

    Raises:
        ConfigError: If the parameters are invalid or the graph does not fit the task.
    """
    settings = read_settings(config)
    notes: list[str] = []
    if settings.task.task == GENERATE_TASK:
        from coalesce.generation.contract import contract_completion

        inputs, outputs = contract_completion(config)
        if inputs or outputs:
            notes.append("auto-completed " + ", ".join(f"{t.name} {t.data_type} {list(t.dims)}"
                                                       for t in (*inputs, *outputs)))
        return Completion(inputs=inputs, outputs=outputs, max_batch_size=None, notes=notes, decoupled=True)
    graph: GraphIO | None = None
    onnx = settings.runtime.onnx_file
    if version_dir is not None and version_file(version_dir, onnx).is_file():
        from coalesce.runtimes.onnx import read_graph_io

        try:
            graph = read_graph_io(version_file(version_dir, onnx))
        except ConfigError as exc:
            notes.append(f"could not read the graph to complete the config: {exc}")
    inputs, outputs = task_type(settings).complete(config, graph)
    max_batch = None if settings.max_batch_size > 0 else DEFAULT_MAX_BATCH_SIZE
    if inputs or outputs or max_batch:
        notes.append("auto-completed " + ", ".join(
            [*(f"input {t.name} {t.data_type} {list(t.dims)}" for t in inputs),
             *(f"output {t.name} {t.data_type} {list(t.dims)}" for t in outputs),
             *([f"max_batch_size {max_batch}"] if max_batch else [])]))
    return Completion(inputs=inputs, outputs=outputs, max_batch_size=max_batch, notes=notes)


def triton_prefetch_blockers(config: Mapping[str, Any]) -> list[str]:
    """The ``dynamic_batching`` settings that turn off the batcher's prefetching, each as ``name value``.

    Triton's priority queue supports prefetching only without ``priority_levels`` and
    with a ``default_queue_policy`` of no timeout, no timeout override and no
    ``max_queue_size`` (core ``scheduler_utils.cc``). Without prefetching, while the
    instance is busy the batcher waits for a slot on its condition variable under a
    private mutex (``WaitForPayloadSlotAvailable``), so the instance's wakeup can be lost
    and a request waits out the batcher's 500 ms timeout: Triton 2.51 does this, and so
    does core's main branch as read on 2026-12-04.
    """
    batching = config.get("dynamic_batching")
    if not isinstance(batching, Mapping):
        return []
    policy = batching.get("default_queue_policy") or {}
    found = [f"{key} {policy[key]}" for key in ("max_queue_size", "default_timeout_microseconds")
             if int(policy.get(key, 0) or 0)]
    if str(policy.get("allow_timeout_override", "false")).lower() == "true":
        found.append("allow_timeout_override true")
    if int(batching.get("priority_levels", 0) or 0):
        found.append(f"priority_levels {batching['priority_levels']}")
    return found
