"""The runtime interface every engine implements, and runtime selection.

A runtime runs the transformer on one padded sub-batch and returns its last
hidden states; tokenisation, coalescing and pooling stay in the pipeline so every
runtime (ONNX Runtime now; TensorRT and torch later) gets them for free.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

import numpy as np

from coalesce.errors import ConfigError
from coalesce.settings import Settings


class Runtime(Protocol):
    """Runs the encoder on one padded sub-batch."""

    name: str

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            token_type_ids: np.ndarray) -> np.ndarray:
        """Return ``last_hidden_state`` ``[rows, tokens, hidden]`` for int64 ``[rows, tokens]`` inputs."""
        ...

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states."""
        ...


@dataclasses.dataclass(frozen=True)
class RuntimeChoice:
    """The runtime picked for a model and the reason, for the load log."""

    runtime: Runtime
    reason: str


def create_runtime(settings: Settings, version_dir: Path) -> RuntimeChoice:
    """Create the runtime the settings ask for.

    ``auto`` picks the best available; only ONNX Runtime on CPU exists so far.

    Raises:
        ConfigError: If the asked runtime or its model file is unavailable.
    """
    if settings.runtime in ("auto", "onnxruntime"):
        from coalesce.runtime.onnx import OnnxRuntime

        runtime = OnnxRuntime(version_dir / settings.onnx_file, intra_op_threads=settings.intra_op_threads,
                              inter_op_threads=settings.inter_op_threads,
                              thread_spinning=settings.thread_spinning)
        reason = ("runtime 'auto': ONNX Runtime on CPU (no GPU runtime is built in yet)"
                  if settings.runtime == "auto" else "runtime 'onnxruntime' asked for in config")
        return RuntimeChoice(runtime=runtime, reason=reason + f"; providers {runtime.providers}")
    raise ConfigError(f"model '{settings.model_name}': runtime '{settings.runtime}' is not available")
