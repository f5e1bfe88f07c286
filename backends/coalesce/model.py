"""Triton entry point of the ``coalesce`` backend: a thin adapter over the core.

It converts ``pb_utils`` requests to plain numpy rows, hands all requests of one
``execute`` to the core pipeline together, and converts results and errors back.
Nothing else lives here: the core (package ``coalesce``) never imports
``triton_python_backend_utils`` and is tested without Triton.
"""

from __future__ import annotations

import ctypes
import gc
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from coalesce import contract
from coalesce.errors import CoalesceError, InvalidInputError, RuntimeFailure
from coalesce.log import Logger
from coalesce.metrics import BufferedMetricFactory, SchedulerMetrics
from coalesce.pipeline import EmbeddingPipeline, RequestInput, RequestResult
from coalesce.serving import (
    AdaptiveScheduler,
    Submission,
    read_parameters,
    scheduler_config,
    triton_queue_timeout_s,
)
from coalesce.settings import Settings


def _triton_error(error: CoalesceError) -> Any:
    """The one place where core error codes become Triton's.

    Looked up per call: ``pb_utils.TritonError`` is bound only after ``model.py`` is imported.
    """
    code = getattr(pb_utils.TritonError, error.code, pb_utils.TritonError.INTERNAL)
    return pb_utils.TritonError(str(error), code)


def _keep_forever(obj: Any) -> Any:
    """Leak one reference so the object is never destroyed, not even at stub exit.

    Triton 2.51 crashes (heap corruption, "malloc(): unaligned fastbin chunk") when a
    model is reloaded and the old instance deletes a custom metric family that the new
    instance has already registered under the same name (server issue #8663; the fix is
    core#471, after 2.51). Never deleting our families and metrics avoids it; the cost is
    a few bytes per metric per reload in the server.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return obj


class _TritonMetricFactory:
    """Creates each metric family once and hands out labelled handles (``coalesce.metrics.MetricFactory``)."""

    def __init__(self) -> None:
        self._families: dict[str, Any] = {}

    def _family(self, name: str, description: str, kind: Any) -> Any:
        if name not in self._families:
            family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
            self._families[name] = _keep_forever(family)
        return self._families[name]

    def _metric(self, name: str, description: str, kind: Any, labels: Mapping[str, str], **extra: Any) -> Any:
        return _keep_forever(self._family(name, description, kind).Metric(labels=dict(labels), **extra))

    def counter(self, name: str, description: str, labels: Mapping[str, str]) -> Any:
        return self._metric(name, description, pb_utils.MetricFamily.COUNTER, labels)

    def gauge(self, name: str, description: str, labels: Mapping[str, str]) -> Any:
        return self._metric(name, description, pb_utils.MetricFamily.GAUGE, labels)

    def histogram(self, name: str, description: str, labels: Mapping[str, str],
                  buckets: Sequence[float]) -> Any:
        return self._metric(name, description, pb_utils.MetricFamily.HISTOGRAM, labels,
                            buckets=[float(b) for b in buckets])


class TritonPythonModel:
    """One model instance of the ``coalesce`` backend."""

    def initialize(self, args: dict[str, str]) -> None:
        """Parse settings, load tokenizer and runtime, create metrics; a bad config fails the load."""
        config = json.loads(args["model_config"])
        settings = Settings.from_model_config(config)  # ConfigError fails the load with its message
        version = args["model_version"]
        version_dir = Path(args["model_repository"]) / version
        logger = Logger(settings.model_name, pb_utils.Logger)
        # Families must outlive their metrics: the factory keeps them, and the model keeps the factory.
        # Every pb_utils metric call is a round trip to the server: record in process, send from a thread.
        self._metric_factory = BufferedMetricFactory(
            _TritonMetricFactory(), interval_s=settings.metrics_interval_ms / 1000,
            on_error=lambda exc: logger.error(f"sending metrics failed: {exc!r}"))
        self._pipeline = EmbeddingPipeline.from_version_dir(
            settings, version_dir, version=version, metric_factory=self._metric_factory, logger=logger,
            instance_kind=args.get("model_instance_kind", "CPU"),
            device_id=int(args.get("model_instance_device_id", 0) or 0), bls_call=_bls_call)
        self._scheduler: AdaptiveScheduler | None = None
        if settings.scheduling == "adaptive":
            delay_us = int(config.get("dynamic_batching", {}).get("max_queue_delay_microseconds", 0) or 0)
            if delay_us:
                logger.warning(f"scheduling is adaptive but Triton's max_queue_delay_microseconds is {delay_us}: "
                               "every request waits that long before the backend sees it; set it to 0")
            queue_timeout_s = triton_queue_timeout_s(config)
            if queue_timeout_s:
                logger.info(f"adaptive: Triton refuses requests after {queue_timeout_s * 1000:.0f} ms in its own "
                            "queue; the backend's deadlines leave that much of target_p99_ms for it")
            self._scheduler = AdaptiveScheduler(
                self._pipeline, scheduler_config(settings, triton_queue_timeout_s=queue_timeout_s),
                SchedulerMetrics(self._metric_factory, model=settings.model_name, version=version), logger)
        logger.info(f"loaded version {version} from {version_dir} on instance {args['model_instance_name']}; "
                    f"settings {settings}")

    def execute(self, requests: list[Any]) -> list[Any] | None:
        """Answer every request of the batch Triton formed, one response each, in order.

        Under adaptive scheduling, hand the requests to the backend's queue: those with an
        answer ready (bad input, a refusal, or computed inline on an idle executor) are
        answered here; for the others the entry is None and the scheduler thread answers
        each through its response sender.
        """
        if self._scheduler is not None:
            ready = self._scheduler.submit([_submission(request) for request in requests])
            return [None if result is None else _response(result) for result in ready]
        results = self._pipeline.embed([_read_request(request) for request in requests])
        return [_response(result) for result in results]

    def finalize(self) -> None:
        """Answer what is queued, finish shared-cache writes, release the runtime, then the metrics."""
        if self._scheduler is not None:
            self._scheduler.close()
        self._pipeline.close()
        self._pipeline = None  # type: ignore[assignment]
        self._metric_factory.close()  # the last values reach Triton before the model goes
        self._metric_factory = None  # type: ignore[assignment]
        # Free what only the cycle collector can, while the stub can still destroy pb_utils
        # objects: its next pass may come at interpreter exit, after shared memory is gone,
        # and destroying a Triton request there crashes the stub (see ``errors.as_result``).
        gc.collect()


def _bls_call(model: str, version: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One BLS request to another model of this server (the ``bls`` runtime's transport)."""
    request = pb_utils.InferenceRequest(
        model_name=model, model_version=int(version) if version else -1,
        requested_output_names=[contract.GRAPH_OUTPUT_HIDDEN],
        inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()])
    response = request.exec()
    if response.has_error():
        raise RuntimeFailure(f"model '{model}' answered: {response.error().message()}")
    tensor = pb_utils.get_output_tensor_by_name(response, contract.GRAPH_OUTPUT_HIDDEN)
    if tensor is None:
        return {}
    if tensor.is_cpu():
        return {contract.GRAPH_OUTPUT_HIDDEN: tensor.as_numpy()}
    import torch  # a GPU target's output: through DLPack, then to the host for pooling

    return {contract.GRAPH_OUTPUT_HIDDEN: torch.utils.dlpack.from_dlpack(tensor.to_dlpack()).float().cpu().numpy()}


def _response(result: RequestResult) -> Any:
    """The Triton response of one result: the embeddings, or the error with its Triton code."""
    if isinstance(result, CoalesceError):
        return pb_utils.InferenceResponse(output_tensors=[], error=_triton_error(result))
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(contract.OUTPUT_EMBEDDING, result)])


class _Responder:
    """Sends a request's one final response through its response sender, from any thread.

    Holds the request itself until then: the sender belongs to it.
    """

    def __init__(self, request: Any) -> None:
        self._request: Any = request
        self._sender = request.get_response_sender()

    def __call__(self, result: RequestResult) -> None:
        self._sender.send(_response(result), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._request = None


def _submission(request: Any) -> Submission:
    """Hand one request to the adaptive scheduler: its rows, parameters, timeout and response sender."""
    respond = _Responder(request)
    rows = _read_request(request)
    parameters = read_parameters(request.parameters())
    if isinstance(parameters, CoalesceError):
        return Submission(rows=parameters, respond=respond)
    tenant, priority = parameters
    return Submission(rows=rows, respond=respond, tenant=tenant, priority=priority,
                      timeout_s=request.timeout() / 1e6, is_cancelled=request.is_cancelled)


def _read_request(request: Any) -> RequestInput:
    """Turn one request's ``TEXT`` tensor into its raw rows, or the error it deserves."""
    tensor = pb_utils.get_input_tensor_by_name(request, contract.INPUT_TEXT)
    if tensor is None:
        return InvalidInputError(f"request has no input '{contract.INPUT_TEXT}'")
    array = tensor.as_numpy()
    if array.ndim != 2 or array.shape[1] != 1:
        return InvalidInputError(
            f"input '{contract.INPUT_TEXT}' has shape {list(array.shape)}, expected [N, 1]")
    if array.dtype != np.object_:
        return InvalidInputError(f"input '{contract.INPUT_TEXT}' has dtype {array.dtype}, expected BYTES")
    return list(array[:, 0])
