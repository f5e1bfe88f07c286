"""TensorRT runtime (TensorRT 10+ Python API): named I/O tensors on a CUDA stream.

Loads the plan that ``coalesce build-engine`` wrote and the JSON beside it (profiles,
precision, TensorRT version). Each sub-batch runs under the tightest optimization
profile that holds its shape (``set_optimization_profile_async``), with
``set_input_shape`` and ``set_tensor_address`` on device buffers and
``execute_async_v3`` on one stream. Buffers are torch CUDA tensors (the ``gpu`` extra
brings CUDA torch), which keeps this module free of a second CUDA binding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from coalesce import contract
from coalesce.errors import ConfigError, RuntimeFailure
from coalesce.profiles import Profile, match_profile, plan_limits


def engine_metadata_path(plan: Path) -> Path:
    """Where the JSON describing ``plan`` lives."""
    return plan.with_name(plan.name + ".json")


def check_version(metadata: dict[str, Any], installed: str, plan: Path) -> None:
    """Fail the load when the engine was built by another TensorRT than the one installed.

    TensorRT plans are not portable across versions; loading one would fail deep inside
    TensorRT with a message that does not say what to do.

    Raises:
        ConfigError: On a mismatch or a plan without metadata.
    """
    built = metadata.get("tensorrt_version")
    if built is None:
        raise ConfigError(f"TensorRT engine {plan} has no metadata ({engine_metadata_path(plan).name}); "
                          "rebuild it with `coalesce build-engine`")
    if built != installed:
        raise ConfigError(f"TensorRT engine {plan} was built with TensorRT {built}, but TensorRT {installed} is "
                          "installed; rebuild it with `coalesce build-engine` inside this container")


class TensorRTRuntime:
    """A deserialized engine, one execution context and one CUDA stream."""

    name = "tensorrt"

    def __init__(self, plan: Path, *, device_id: int = 0) -> None:
        """Load ``plan`` on GPU ``device_id``.

        Raises:
            ConfigError: If the plan, its metadata or a matching TensorRT is missing, or it does not deserialize.
        """
        import tensorrt as trt
        import torch

        meta_path = engine_metadata_path(plan)
        if not plan.is_file():
            raise ConfigError(f"TensorRT engine not found: {plan} (build it with `coalesce build-engine`)")
        metadata = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        check_version(metadata, str(trt.__version__), plan)
        self.profiles = [Profile.from_dict(p) for p in metadata["profiles"]]
        self.max_rows, self.max_length = plan_limits(self.profiles)
        self._torch = torch
        self.device = torch.device(f"cuda:{device_id}")
        torch.cuda.set_device(self.device)
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._engine = trt.Runtime(self._logger).deserialize_cuda_engine(plan.read_bytes())
        if self._engine is None:
            raise ConfigError(f"TensorRT could not deserialize {plan}; rebuild it with `coalesce build-engine`")
        if self._engine.num_optimization_profiles != len(self.profiles):
            raise ConfigError(f"{plan} has {self._engine.num_optimization_profiles} profiles but its metadata "
                              f"lists {len(self.profiles)}; rebuild it")
        self._context = self._engine.create_execution_context()
        self._stream = torch.cuda.Stream(device=self.device)
        out_dtype = self._engine.get_tensor_dtype(contract.GRAPH_OUTPUT_HIDDEN)
        self._out_dtype = torch.float16 if out_dtype == trt.DataType.HALF else torch.float32
        self._hidden_size = int(self._engine.get_tensor_shape(contract.GRAPH_OUTPUT_HIDDEN)[-1])
        self._profile = -1

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states."""
        return self._hidden_size

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            token_type_ids: np.ndarray) -> np.ndarray:
        """Run one padded sub-batch under the profile that holds it; return ``last_hidden_state``.

        Raises:
            RuntimeFailure: If no profile holds the shape or TensorRT fails.
        """
        torch = self._torch
        rows, length = input_ids.shape
        index = match_profile(self.profiles, rows, length)
        if index is None:
            raise RuntimeFailure(f"no TensorRT profile holds a pass of {rows} rows x {length} tokens "
                                 f"(profiles: {self.profiles})")
        context = self._context
        with torch.cuda.stream(self._stream):
            if index != self._profile:
                context.set_optimization_profile_async(index, self._stream.cuda_stream)
                self._profile = index
            keep = []
            for name, array in ((contract.GRAPH_INPUT_IDS, input_ids), (contract.GRAPH_ATTENTION_MASK, attention_mask),
                                (contract.GRAPH_TOKEN_TYPE_IDS, token_type_ids)):
                tensor = torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)
                keep.append(tensor)
                context.set_input_shape(name, (rows, length))
                context.set_tensor_address(name, tensor.data_ptr())
            out = torch.empty((rows, length, self._hidden_size), dtype=self._out_dtype, device=self.device)
            context.set_tensor_address(contract.GRAPH_OUTPUT_HIDDEN, out.data_ptr())
            if not context.execute_async_v3(self._stream.cuda_stream):
                raise RuntimeFailure(f"TensorRT failed on a batch of shape {input_ids.shape}")
            result = out.float().cpu()
        self._stream.synchronize()
        return result.numpy()
