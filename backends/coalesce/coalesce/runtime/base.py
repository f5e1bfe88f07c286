"""The runtime interface every engine implements, and runtime selection.

A runtime runs the transformer on one padded sub-batch and returns its last
hidden states; tokenisation, coalescing and pooling stay in the pipeline so every
runtime (ONNX Runtime on CPU or GPU, TensorRT, torch, or another Triton model through
BLS) gets them for free.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

import numpy as np

from coalesce.errors import ConfigError
from coalesce.runtime.bls import BlsCall
from coalesce.runtime.select import Capabilities, choose, probe
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


def create_runtime(settings: Settings, version_dir: Path, *, instance_kind: str = "CPU", device_id: int = 0,
                   bls_call: BlsCall | None = None, caps: Capabilities | None = None) -> RuntimeChoice:
    """Create the runtime the settings ask for, on the device Triton gave the instance.

    Raises:
        ConfigError: If the asked runtime, its files or its packages are unavailable.
    """
    caps = caps if caps is not None else probe()
    choice = choose(settings.runtime, caps, engine_path=version_dir / settings.engine_file,
                    torch_model_dir=version_dir / settings.torch_model_dir, instance_kind=instance_kind,
                    model_name=settings.model_name, bls_model=settings.bls_model)
    runtime: Runtime
    if choice.runtime == "onnxruntime":
        from coalesce.runtime.onnx import OnnxRuntime

        runtime = OnnxRuntime(version_dir / settings.onnx_file, intra_op_threads=settings.intra_op_threads,
                              inter_op_threads=settings.inter_op_threads, thread_spinning=settings.thread_spinning,
                              providers=choice.providers, device_id=device_id)
        return RuntimeChoice(runtime=runtime, reason=choice.reason + f"; providers {runtime.providers}")
    if choice.runtime == "torch":
        from coalesce.runtime.torch_runtime import TorchRuntime, buckets_from

        device = f"cuda:{device_id}" if choice.device == "cuda" else "cpu"
        buckets = (buckets_from(rows=sorted({1, 8, min(32, settings.max_batch_rows), settings.max_batch_rows}),
                                lengths=(32, 64, 128, settings.max_sequence_length))
                   if settings.cuda_graphs and choice.device == "cuda" else ())
        if settings.cuda_graphs and choice.device != "cuda":
            raise ConfigError(f"model '{settings.model_name}': cuda_graphs needs torch on CUDA; {choice.reason}")
        runtime = TorchRuntime(version_dir / settings.torch_model_dir, device=device,
                               precision=settings.precision if choice.device == "cuda" else "fp32",
                               cuda_graph_buckets=buckets, threads=settings.intra_op_threads)
        return RuntimeChoice(runtime=runtime, reason=choice.reason + f"; {device}, {runtime.dtype}"
                             + (f", CUDA graphs for {len(buckets)} buckets" if buckets else ""))
    if choice.runtime == "tensorrt":
        from coalesce.runtime.tensorrt import TensorRTRuntime

        runtime = TensorRTRuntime(version_dir / settings.engine_file, device_id=device_id)
        return RuntimeChoice(runtime=runtime, reason=choice.reason + f"; profiles {runtime.profiles}")
    if choice.runtime == "bls":
        if bls_call is None:
            raise ConfigError(f"model '{settings.model_name}': runtime 'bls' only runs inside Triton")
        from coalesce.runtime.bls import BlsRuntime

        runtime = BlsRuntime(bls_call, settings.bls_model, version=settings.bls_model_version,
                             hidden_size=settings.embedding_dim)
        return RuntimeChoice(runtime=runtime, reason=choice.reason)
    raise ConfigError(f"model '{settings.model_name}': runtime '{choice.runtime}' is not built in")
