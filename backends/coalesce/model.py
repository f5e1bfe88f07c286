"""Triton entry point of the ``coalesce`` backend: a thin adapter over the core.

``TritonPythonModel`` loads one of two small adapters, by task: ``_RowModel`` converts
``pb_utils`` requests to plain numpy tensors by name, hands all requests of one
``execute`` to the model's pipeline together (or to the adaptive scheduler), and
converts results and errors back; ``_GenerateModel`` hands each request to the
generation engine, which answers through the request's response sender.
``auto_complete_config`` fills in what a minimal ``config.pbtxt`` leaves out. Nothing else
lives here: the core (package ``coalesce``) never imports ``triton_python_backend_utils``
and is tested without Triton, for every task.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import json
import queue
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from coalesce.batching.pipeline import RequestResult
from coalesce.core.errors import CoalesceError, RuntimeFailure, as_result
from coalesce.core.limits import oversize_error, request_bytes
from coalesce.core.tensors import TensorSpec
from coalesce.generation.contract import INPUT_NAMES as GENERATION_INPUTS
from coalesce.generation.contract import response_outputs
from coalesce.generation.events import GenerationEvent
from coalesce.generation.loader import load_engine
from coalesce.loader import complete_config, load_pipeline, read_settings, triton_prefetch_blockers
from coalesce.observability.log import Logger
from coalesce.observability.metrics import BufferedMetricFactory, SchedulerMetrics
from coalesce.scheduling.driver import (
    AdaptiveScheduler,
    Submission,
    read_parameters,
    scheduler_config,
    triton_queue_timeout_s,
)
from coalesce.settings import GENERATE_TASK


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
    """Creates each metric family once and hands out labelled handles (``coalesce.observability.metrics``)."""

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


# SIGUSR1 makes a stub print every thread's Python stack to the server's log: how to see where a model that
# does not answer or does not unload is stuck (the launcher sends it to stubs still running after a drain).
faulthandler.register(signal.SIGUSR1, all_threads=True)

class TritonPythonModel:
    """One model instance of the ``coalesce`` backend."""

    @staticmethod
    def auto_complete_config(auto_complete_model_config: Any) -> Any:
        """Fill in what the task and the version's graph can say: inputs, outputs, a row limit, dynamic batching."""
        config = auto_complete_model_config.as_dict()
        model_dir = getattr(pb_utils, "get_model_dir", None)
        completion = complete_config(config, Path(model_dir()) if model_dir is not None else None)
        for spec in completion.inputs:
            auto_complete_model_config.add_input(spec.as_config())
        _allow_ragged_batch(auto_complete_model_config, [s.name for s in completion.inputs if s.variable_axes])
        for spec in completion.outputs:
            auto_complete_model_config.add_output(spec.as_config())
        if completion.max_batch_size:
            auto_complete_model_config.set_max_batch_size(completion.max_batch_size)
        if completion.decoupled:
            auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        elif "sequence_batching" not in config and "ensemble_scheduling" not in config:
            auto_complete_model_config.set_dynamic_batching()
        logger = Logger(str(config.get("name", "model")), pb_utils.Logger)
        for note in completion.notes:
            logger.info(note)
        return auto_complete_model_config

    def initialize(self, args: dict[str, str]) -> None:
        """Parse settings, then load the task's adapter; a bad config fails the load with its message."""
        config = json.loads(args["model_config"])
        settings = read_settings(config)
        self._logger = logger = Logger(settings.model_name, pb_utils.Logger)
        # Families must outlive their metrics: the factory keeps them, and the model keeps the factory.
        # Every pb_utils metric call is a round trip to the server: record in process, send from a thread.
        self._metric_factory = BufferedMetricFactory(
            _TritonMetricFactory(), interval_s=settings.metrics.metrics_interval_ms / 1000,
            on_error=lambda exc: logger.error(f"sending metrics failed: {exc!r}"))
        adapter = _GenerateModel if settings.task.task == GENERATE_TASK else _RowModel
        try:
            self._model: _GenerateModel | _RowModel = adapter(config, settings, args, self._metric_factory, logger)
        except BaseException:
            # Triton never calls finalize after a failed initialize: a flusher thread left running keeps the
            # stub, and with it the server's model, alive (the server's stop then waits out its exit timeout).
            self._metric_factory.close(flush=False)
            raise
        logger.info(f"loaded version {args['model_version']} from {args['model_repository']} on instance "
                    f"{args['model_instance_name']}: task '{settings.task.task}'; parameters set {settings.changed()}")

    def execute(self, requests: list[Any]) -> list[Any] | None:
        """Answer every request of the batch Triton formed (or hand them on: see the adapters)."""
        return self._model.execute(requests)

    def finalize(self) -> None:
        """Let the adapter finish what it holds, then send the last metrics.

        The metrics thread stops and the cycle collector runs even if the adapter's close
        fails (that is logged): either left undone keeps the model from unloading.
        """
        try:
            self._model.close()
        except Exception as exc:
            self._logger.error(f"closing the model failed: {exc!r}; unloading it anyway")
        self._model = None  # type: ignore[assignment]
        self._metric_factory.close()  # the last values reach Triton before the model goes
        self._metric_factory = None  # type: ignore[assignment]
        # Free what only the cycle collector can, while the stub can still destroy pb_utils
        # objects: its next pass may come at interpreter exit, after shared memory is gone,
        # and destroying a Triton request there crashes the stub (see ``errors.as_result``).
        gc.collect()


def _instance(args: Mapping[str, str]) -> dict[str, Any]:
    """Where Triton placed this instance: its kind and device."""
    return {"instance_kind": args.get("model_instance_kind", "CPU"),
            "device_id": int(args.get("model_instance_device_id", 0) or 0)}


class _RowModel:
    """A row task (embedding, classify, similarity, tensor): one response per request, from the pipeline."""

    def __init__(self, config: dict[str, Any], settings: Any, args: Mapping[str, str],
                 metric_factory: BufferedMetricFactory, logger: Logger) -> None:
        version = args["model_version"]
        self._pipeline = load_pipeline(
            config, Path(args["model_repository"]) / version, version=version, settings=settings,
            metric_factory=metric_factory, logger=logger, bls_call=_bls_call, **_instance(args))
        self._inputs: tuple[TensorSpec, ...] = self._pipeline.task.inputs
        self._scheduler: AdaptiveScheduler | None = None
        if settings.scheduler.scheduling == "adaptive":
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
                SchedulerMetrics(metric_factory, model=settings.model_name, version=version), logger)
        else:
            blockers = triton_prefetch_blockers(config)
            if blockers:
                logger.warning(f"dynamic_batching sets {', '.join(blockers)}: that turns off Triton's prefetching, "
                               "and while this instance is busy Triton's batcher can then hold a request for its "
                               "500 ms idle wait (measured on 2.51: perf/results/queue-policy-*.md); leave them "
                               "out, or set parameter scheduling to 'adaptive' (with such a policy it runs no pass "
                               "inside execute)")
        unbatched = [t["name"] for t in config.get("input", [])
                     if -1 in [int(d) for d in t.get("dims", [])] and not t.get("allow_ragged_batch")]
        if unbatched:
            logger.warning(f"inputs {unbatched} have variable dims without allow_ragged_batch: Triton's dynamic "
                           "batcher hands over only requests of equal shapes together; set allow_ragged_batch: true "
                           "on them so requests of every length are coalesced")

    def execute(self, requests: list[Any]) -> list[Any]:
        """One response per request, in order.

        Under adaptive scheduling, hand the requests to the backend's queue: those with an
        answer ready (bad input, a refusal, or computed inline on an idle executor) are
        answered here; for the others the entry is None and the scheduler thread answers
        each through its response sender.
        """
        if self._scheduler is not None:
            ready = self._scheduler.submit([self._submission(request) for request in requests])
            return [None if result is None else _response(result) for result in ready]
        pipeline = self._pipeline
        results = pipeline.run(pipeline.read_all([self._tensors(request) for request in requests]))
        return [_response(result) for result in results]

    def close(self) -> None:
        """Answer what is queued, finish shared-cache writes, release the runtime."""
        if self._scheduler is not None:
            self._scheduler.close()
        self._pipeline.close()
        self._pipeline = None  # type: ignore[assignment]

    def _tensors(self, request: Any) -> dict[str, np.ndarray]:
        """The request's inputs by name, as numpy (absent optional inputs left out), in the request's own memory."""
        tensors: dict[str, np.ndarray] = {}
        for spec in self._inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
            if tensor is not None:
                tensors[spec.name] = tensor.as_numpy()
        return tensors

    def _submission(self, request: Any) -> Submission:
        """Hand one request to the adaptive scheduler: its tensors, parameters, timeout and response sender.

        Rows outlive ``execute`` here, so numeric tensors are copied out of the request's
        shared memory (never depending on how long the server keeps it), once the
        request is known to be within ``max_request_bytes``.
        """
        respond = _Responder(request)
        tensors = self._tensors(request)
        size = request_bytes(tensors)
        limit = self._pipeline.max_request_bytes
        if limit and size > limit:
            return Submission(tensors=oversize_error(size, limit), respond=respond)
        tensors = {name: array if array.dtype == np.object_ else np.array(array, copy=True)
                   for name, array in tensors.items()}
        parameters = read_parameters(request.parameters())
        if isinstance(parameters, CoalesceError):
            return Submission(tensors=parameters, respond=respond)
        tenant, priority = parameters
        return Submission(tensors=tensors, respond=respond, tenant=tenant, priority=priority,
                          timeout_s=request.timeout() / 1e6, is_cancelled=request.is_cancelled, size_bytes=size)


def _allow_ragged_batch(model_config: Any, names: Sequence[str]) -> None:
    """Set ``allow_ragged_batch`` on the completed inputs ``names`` (variable dims).

    Without it Triton's dynamic batcher puts only requests of equal shapes in one
    ``execute``; with it, requests of every length come together and the task pads them.
    ``ModelConfig.add_input`` takes no such property, but the stub sends back the
    object's ``_model_config`` dict as it is (python_backend ``pb_stub.cc``,
    ``AutoCompleteModelConfig``), so the property is set on the entries there.
    """
    config = getattr(model_config, "_model_config", None)
    if not names or not isinstance(config, dict):
        return
    for entry in config.get("input", []):
        if entry.get("name") in names:
            entry["allow_ragged_batch"] = True


def _bls_call(model: str, version: str, inputs: Mapping[str, np.ndarray],
              outputs: Sequence[str]) -> dict[str, np.ndarray]:
    """One BLS request to another model of this server (the ``bls`` runtime's transport)."""
    request = pb_utils.InferenceRequest(
        model_name=model, model_version=int(version) if version else -1, requested_output_names=list(outputs),
        inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()])
    response = request.exec()
    if response.has_error():
        raise RuntimeFailure(f"model '{model}' answered: {response.error().message()}")
    found: dict[str, np.ndarray] = {}
    for name in outputs:
        tensor = pb_utils.get_output_tensor_by_name(response, name)
        if tensor is None:
            continue
        if tensor.is_cpu():
            found[name] = tensor.as_numpy()
        else:
            import torch  # a GPU target's output: through DLPack, then to the host for the task's own step

            found[name] = torch.utils.dlpack.from_dlpack(tensor.to_dlpack()).cpu().numpy()
    return found


def _response(result: RequestResult) -> Any:
    """The Triton response of one result: the outputs by name, or the error with its Triton code."""
    if isinstance(result, CoalesceError):
        return pb_utils.InferenceResponse(output_tensors=[], error=_triton_error(result))
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, value) for name, value in result.items()])


class _GenerateModel:
    """Task ``generate``: each request goes to the generation engine, which answers through its response sender."""

    def __init__(self, config: dict[str, Any], settings: Any, args: Mapping[str, str],
                 metric_factory: BufferedMetricFactory, logger: Logger) -> None:
        version = args["model_version"]
        self._engine = load_engine(config, Path(args["model_repository"]) / version, settings=settings,
                                   version=version, metric_factory=metric_factory, logger=logger, **_instance(args))
        self._static = settings.generate.generation_batching == "request"
        self._batched = settings.max_batch_size > 0
        self._outbox = _Outbox(logger, metric_factory.gauge(
            "coalesce_generate_open_responses",
            "Generation requests whose final response is not sent yet (each holds Triton's unload of the model)",
            {"model": settings.model_name, "version": version}))
        self._logger = logger

    def execute(self, requests: list[Any]) -> None:
        """Hand each request to the engine; a bad or refused one is answered here, its neighbours still queue.

        Under ``generation_batching: request`` this waits until the whole batch has
        finished, so that Triton holds the next batch back (static batching).
        """
        finished = []
        for request in requests:
            stream = _Stream(request, self._outbox, batched=self._batched)
            tensors = {}
            for name in GENERATION_INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    tensors[name] = tensor.as_numpy()
            try:
                self._engine.submit(tensors, request.parameters(), stream, is_cancelled=stream.is_cancelled)
            except CoalesceError as exc:
                stream(GenerationEvent(final=True, error=as_result(exc)))
                continue
            finished.append(stream.done)
        if self._static:
            for done in finished:
                done.wait()

    def close(self) -> None:
        """Let running requests finish (up to the engine's drain), then send what is queued."""
        started = time.monotonic()
        self._engine.close()
        self._outbox.close()
        self._logger.info(f"generation closed in {time.monotonic() - started:.1f} s")


class _Outbox:
    """Sends generation responses from its own thread, in the order they were put.

    ``ResponseSender.send`` is a round trip to the server (it releases the GIL while it
    waits); sent from the engine's step thread, every streamed token of every sequence
    would lengthen every step. From here they go out while the next step computes.
    """

    def __init__(self, logger: Logger, open_gauge: Any) -> None:
        self._queue: queue.SimpleQueue[tuple[_Stream, GenerationEvent] | None] = queue.SimpleQueue()
        self._logger = logger
        self._open = 0
        self._open_lock = threading.Lock()
        self._open_gauge = open_gauge
        self._thread = threading.Thread(target=self._run, name="coalesce-responses", daemon=True)
        self._thread.start()

    def put(self, stream: _Stream, event: GenerationEvent) -> None:
        self._queue.put((stream, event))

    def opened(self, change: int) -> None:
        """Count a stream opened (+1) or finished (-1): the gauge of responses still owed."""
        with self._open_lock:
            self._open += change
            self._open_gauge.set(self._open)

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=3)
        if self._thread.is_alive():
            self._logger.warning("closing: responses still unsent after 3 s; leaving them")

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            stream, event = item
            try:
                stream.send(event)
            except Exception as exc:
                # A final response that fails to go may leave Triton's response factory, and so the model's
                # unload, held: logged as an error, so it shows among a failed stop's errors.
                log = self._logger.error if event.final else self._logger.warning
                log(f"sending a generation {'final ' if event.final else ''}response failed: {exc!r}")
            # Hold no stream while waiting for the next: Triton unloads the model only once every
            # response sender is gone, and this frame would keep the last one alive until then.
            del item, stream, event


class _Stream:
    """A generation request's responses, through its response sender (by way of the model's outbox).

    Each event becomes one response (``text_output``); the final one carries Triton's
    final flag, and then the request is let go and ``done`` is set.
    """

    def __init__(self, request: Any, outbox: _Outbox, *, batched: bool) -> None:
        self._request: Any = request
        self._sender = request.get_response_sender()
        self._outbox = outbox
        self._batched = batched
        # Once the final response is out, Triton frees the request's response factory: asking
        # whether it was cancelled after that reads freed memory and crashes the server.
        self._lock = threading.Lock()
        self.done = threading.Event()
        outbox.opened(1)

    def __call__(self, event: GenerationEvent) -> None:
        self._outbox.put(self, event)

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request; False once its final response is sent."""
        with self._lock:
            return self._request is not None and bool(self._request.is_cancelled())

    def send(self, event: GenerationEvent) -> None:
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if event.final else 0
        with self._lock:
            try:
                if self._request is None:
                    return  # already final
                if event.error is not None or event.request is None:
                    error = event.error or RuntimeFailure("the engine answered without the request it read")
                    response = pb_utils.InferenceResponse(output_tensors=[], error=_triton_error(error))
                else:
                    outputs = response_outputs(event.request, event, batched=self._batched)
                    response = pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(name, value) for name, value in outputs.items()])
                self._sender.send(response, flags=flags)
            finally:
                if event.final:
                    # Let go of the request and its sender even if the send failed (the client gone):
                    # a sender still referenced holds the model's unload back.
                    if self._sender is not None:
                        self._outbox.opened(-1)
                    self._request = None
                    self._sender = None
                    self.done.set()


class _Responder:
    """Sends a request's one final response through its response sender, from any thread.

    Holds the request itself until then: the sender belongs to it.
    """

    def __init__(self, request: Any) -> None:
        self._request: Any = request
        self._sender = request.get_response_sender()

    def __call__(self, result: RequestResult) -> None:
        try:
            self._sender.send(_response(result), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            self._request = None
            self._sender = None  # a sender still referenced holds the model's unload back
