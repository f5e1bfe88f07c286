"""ONNX Runtime: the CPU provider, or the TensorRT and CUDA providers of ``onnxruntime-gpu``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from coalesce import contract
from coalesce.errors import ConfigError, RuntimeFailure


class OnnxRuntime:
    """An ONNX Runtime session over the exported encoder graph."""

    name = "onnxruntime"

    def __init__(self, path: Path, *, intra_op_threads: int, inter_op_threads: int,
                 thread_spinning: bool = True, providers: Sequence[str] = ("CPUExecutionProvider",),
                 device_id: int = 0) -> None:
        """Open the graph with the given thread counts (0 lets ONNX Runtime choose) and providers, best first.

        Raises:
            ConfigError: If the file is missing or is not the expected graph.
        """
        if not path.is_file():
            raise ConfigError(f"ONNX model not found: {path} (run `make setup` to export it)")
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
        names = {i.name for i in self._session.get_inputs()}
        expected = {contract.GRAPH_INPUT_IDS, contract.GRAPH_ATTENTION_MASK, contract.GRAPH_TOKEN_TYPE_IDS}
        if names != expected:
            raise ConfigError(f"ONNX model {path} has inputs {sorted(names)}, expected {sorted(expected)}")
        outputs = self._session.get_outputs()
        if outputs[0].name != contract.GRAPH_OUTPUT_HIDDEN:
            raise ConfigError(f"ONNX model {path} has first output '{outputs[0].name}', "
                              f"expected '{contract.GRAPH_OUTPUT_HIDDEN}'")
        width = outputs[0].shape[-1]
        if not isinstance(width, int):
            raise ConfigError(f"ONNX model {path} has no static hidden width (shape {outputs[0].shape})")
        self._hidden_size = width
        self.providers = self._session.get_providers()

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states."""
        return self._hidden_size

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            token_type_ids: np.ndarray) -> np.ndarray:
        """Run one padded sub-batch; return ``last_hidden_state``.

        Raises:
            RuntimeFailure: If ONNX Runtime fails on this batch.
        """
        feeds = {contract.GRAPH_INPUT_IDS: input_ids, contract.GRAPH_ATTENTION_MASK: attention_mask,
                 contract.GRAPH_TOKEN_TYPE_IDS: token_type_ids}
        try:
            (hidden,) = self._session.run([contract.GRAPH_OUTPUT_HIDDEN], feeds)
        except Exception as exc:
            raise RuntimeFailure(f"ONNX Runtime failed on a batch of shape {input_ids.shape}: {exc}") from exc
        return np.asarray(hidden)
