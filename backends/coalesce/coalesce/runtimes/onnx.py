"""ONNX Runtime: the CPU provider, or the TensorRT and CUDA providers of ``onnxruntime-gpu``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from coalesce.core.errors import ConfigError, RuntimeFailure
from coalesce.core.tensors import ONNX_TO_TRITON, GraphIO, GraphTensor
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


class OnnxRuntime:
    """An ONNX Runtime session over any graph: named tensors in, named tensors out."""

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
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = inter_op_threads
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if thread_spinning else "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "1" if thread_spinning else "0")
        try:
            gpu_options = {"device_id": str(device_id)}
            chosen = [(p, gpu_options) if p != "CPUExecutionProvider" else p for p in providers]
            self._session = ort.InferenceSession(str(path), sess_options=options, providers=chosen)
        except Exception as exc:  # onnxruntime raises its own untyped exceptions
            raise ConfigError(f"cannot load ONNX model {path}: {exc}") from exc
        self.path = path
        self.graph = graph_io(self._session)
        self.providers = self._session.get_providers()

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
        """Run one pass; return the named ``outputs``.

        Raises:
            RuntimeFailure: If ONNX Runtime fails on this pass.
        """
        try:
            values = self._session.run(list(outputs), dict(feeds))
        except Exception as exc:
            shapes = {name: list(array.shape) for name, array in feeds.items()}
            raise RuntimeFailure(f"ONNX Runtime failed on a pass with inputs {shapes}: {exc}") from exc
        return {name: np.asarray(value) for name, value in zip(outputs, values, strict=True)}
