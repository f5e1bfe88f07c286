"""ONNX Runtime: the CPU provider, or the TensorRT and CUDA providers of ``onnxruntime-gpu``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from coalesce.core.errors import ConfigError, RuntimeFailure
from coalesce.core.tensors import ONNX_TO_TRITON, GraphIO, GraphTensor
from coalesce.observability.metrics import Counter
from coalesce.runtimes.cores import CoreBoard, sharing_note, start_borrowed
from coalesce.settings import RuntimeOptions


def graph_io(session: ort.InferenceSession) -> GraphIO:
    """The inputs and outputs of an ONNX Runtime session: names, data types and shapes (None where symbolic)."""
    def describe(args: Sequence[ort.NodeArg]) -> tuple[GraphTensor, ...]:
        return tuple(GraphTensor(a.name, ONNX_TO_TRITON.get(a.type),
                                 tuple(d if isinstance(d, int) and d > 0 else None for d in a.shape))
                     for a in args)

    return GraphIO(inputs=describe(session.get_inputs()), outputs=describe(session.get_outputs()))


def read_graph_io(path: Path) -> GraphIO:
    """The inputs and outputs of the ONNX graph at ``path``, without optimising it (for config auto-completion).

    Raises:
        ConfigError: If the file is missing or not an ONNX graph.
    """
    if not path.is_file():
        raise ConfigError(f"ONNX model not found: {path}")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own untyped exceptions
        raise ConfigError(f"cannot load ONNX model {path}: {exc}") from exc
    return graph_io(session)


def _session(path: Path, *, threads: int, inter_op_threads: int, spinning: bool,
             providers: Sequence[str], device_id: int) -> ort.InferenceSession:
    """One ONNX Runtime session over ``path`` on ``threads`` intra-op threads (0: ONNX Runtime chooses).

    Raises:
        ConfigError: If ONNX Runtime cannot load the graph.
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = inter_op_threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "1" if spinning else "0")
    try:
        gpu_options = {"device_id": str(device_id)}
        chosen = [(p, gpu_options) if p != "CPUExecutionProvider" else p for p in providers]
        return ort.InferenceSession(str(path), sess_options=options, providers=chosen)
    except Exception as exc:  # onnxruntime raises its own untyped exceptions
        raise ConfigError(f"cannot load ONNX model {path}: {exc}") from exc


class OnnxRuntime:
    """An ONNX Runtime session over any graph: named tensors in, named tensors out.

    Sharing the cores (``share_cores``), it holds a second session on every core and runs each
    pass on the wide one while no other model of the server computes, on its own
    ``intra_op_threads`` otherwise.
    """

    name = "onnxruntime"

    def __init__(self, path: Path, *, intra_op_threads: int = 0, inter_op_threads: int = 1,
                 thread_spinning: bool = True, providers: Sequence[str] = ("CPUExecutionProvider",),
                 device_id: int = 0) -> None:
        """Open the graph with the given thread counts (0 lets ONNX Runtime choose) and providers, best first.

        Raises:
            ConfigError: If the file is missing or ONNX Runtime cannot load it.
        """
        if not path.is_file():
            raise ConfigError(f"ONNX model not found: {path} (run `make setup`, or put the model's graph there)")
        self._session = _session(path, threads=intra_op_threads, inter_op_threads=inter_op_threads,
                                 spinning=thread_spinning, providers=providers, device_id=device_id)
        self.path = path
        self.graph = graph_io(self._session)
        self.providers = self._session.get_providers()
        self.board: CoreBoard | None = None
        self._wide: ort.InferenceSession | None = None
        self._threads = (intra_op_threads, inter_op_threads, thread_spinning, tuple(providers), device_id)
        #: Passes run on every core while sharing (no neighbour computed when they began).
        self.wide_passes = 0
        self._wide_counter: Counter | None = None

    def share_cores(self, board: CoreBoard, borrowed_priority: str = "idle",
                    wide_passes: Counter | None = None) -> str:
        """Share the cores with the server's other models through ``board``; return what was set up, for the log.

        Each pass then marks the board; where ``intra_op_threads`` is below the cores, a second
        session on every core runs the passes no neighbour computes beside. ``borrowed_priority``
        ``idle`` runs that session's extra threads at the kernel's idle priority; ``wide_passes``
        counts the passes run on every core. Only on the CPU.
        """
        self._wide_counter = wide_passes
        intra, inter, spinning, providers, device_id = self._threads
        if self.providers != ["CPUExecutionProvider"]:
            board.close()
            return "core sharing: off (not on the CPU)"
        self.board = board  # a model on every core still marks the board, so its neighbours keep to their share
        if not 0 < intra < board.cores:
            return f"core sharing: every pass on all {board.cores} cores, marked on {board.path} slot {board.slot}"
        self._wide, count = start_borrowed(
            lambda: _session(self.path, threads=board.cores, inter_op_threads=inter, spinning=spinning,
                             providers=providers, device_id=device_id), borrowed_priority)
        return sharing_note(board, intra, count, borrowed_priority)

    @classmethod
    def from_options(cls, path: Path, options: RuntimeOptions, *,
                     providers: Sequence[str] = ("CPUExecutionProvider",), device_id: int = 0) -> OnnxRuntime:
        """A session over ``path`` with the model's thread settings.

        Raises:
            ConfigError: If the file is missing or ONNX Runtime cannot load it.
        """
        return cls(path, intra_op_threads=options.intra_op_threads, inter_op_threads=options.inter_op_threads,
                   thread_spinning=options.thread_spinning, providers=providers, device_id=device_id)

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one pass (on every core if no neighbour computes); return the named ``outputs``.

        Raises:
            RuntimeFailure: If ONNX Runtime fails on this pass.
        """
        if self.board is None:
            return self._run(self._session, feeds, outputs)
        with self.board.computing() as threads:
            if self._wide is not None and threads > self.board.own_threads:
                self.wide_passes += 1
                if self._wide_counter is not None:
                    self._wide_counter.increment(1)
                return self._run(self._wide, feeds, outputs)
            return self._run(self._session, feeds, outputs)

    @staticmethod
    def _run(session: ort.InferenceSession, feeds: Mapping[str, np.ndarray],
             outputs: Sequence[str]) -> dict[str, np.ndarray]:
        try:
            values = session.run(list(outputs), dict(feeds))
        except Exception as exc:
            shapes = {name: list(array.shape) for name, array in feeds.items()}
            raise RuntimeFailure(f"ONNX Runtime failed on a pass with inputs {shapes}: {exc}") from exc
        return {name: np.asarray(value) for name, value in zip(outputs, values, strict=True)}
