"""TensorRT runtime (TensorRT 10+ Python API): named I/O tensors on a CUDA stream.

Loads the plan that ``coalesce build-engine`` wrote and the JSON beside it (profiles,
precision, TensorRT version). Each pass runs under the tightest optimization profile
that holds its rows and length (``set_optimization_profile_async``), with
``set_input_shape`` and ``set_tensor_address`` for every named input, outputs shaped
as the context reports them, and ``execute_async_v3`` on one stream. Buffers are torch CUDA tensors (the ``gpu`` extra
brings CUDA torch), which keeps this module free of a second CUDA binding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coalesce.core.errors import ConfigError, RuntimeFailure
from coalesce.core.tensors import GraphIO, GraphTensor
from coalesce.runtimes.profiles import Profile, match_profile, plan_limits


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
    """A deserialized engine, one execution context and one CUDA stream; named tensors in and out."""

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
        self._trt = trt
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
        inputs: list[GraphTensor] = []
        outputs: list[GraphTensor] = []
        for index in range(self._engine.num_io_tensors):
            name = self._engine.get_tensor_name(index)
            shape = tuple(int(d) if int(d) >= 0 else None for d in self._engine.get_tensor_shape(name))
            tensor = GraphTensor(name, _TRITON_TYPES.get(str(self._engine.get_tensor_dtype(name)).split(".")[-1]),
                                 shape)
            is_input = self._engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (inputs if is_input else outputs).append(tensor)
        self.graph = GraphIO(inputs=tuple(inputs), outputs=tuple(outputs))
        self._profile = -1

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one padded pass under the profile that holds it; return the named ``outputs`` on the host.

        Raises:
            RuntimeFailure: If no profile holds the pass's shape or TensorRT fails.
        """
        torch, trt = self._torch, self._trt
        rows = len(next(iter(feeds.values())))
        length = max((array.shape[axis] for name, array in feeds.items()
                      for axis in _variable_axes(self.graph.input(name))), default=1)
        index = match_profile(self.profiles, rows, length)
        if index is None:
            raise RuntimeFailure(f"no TensorRT profile holds a pass of {rows} rows x {length} positions "
                                 f"(profiles: {self.profiles})")
        context = self._context
        with torch.cuda.stream(self._stream):
            if index != self._profile:
                context.set_optimization_profile_async(index, self._stream.cuda_stream)
                self._profile = index
            keep = []
            for name, array in feeds.items():
                tensor = torch.from_numpy(np.ascontiguousarray(array)).to(self.device, non_blocking=True)
                keep.append(tensor)
                context.set_input_shape(name, tuple(array.shape))
                context.set_tensor_address(name, tensor.data_ptr())
            results = {}
            for name in outputs:
                shape = tuple(context.get_tensor_shape(name))
                dtype = trt.nptype(self._engine.get_tensor_dtype(name))
                out = torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name), device=self.device)
                context.set_tensor_address(name, out.data_ptr())
                results[name] = out
            if not context.execute_async_v3(self._stream.cuda_stream):
                raise RuntimeFailure(f"TensorRT failed on a pass of {rows} rows x {length} positions")
            host = {name: (out.float() if out.is_floating_point() else out).cpu() for name, out in results.items()}
        self._stream.synchronize()
        return {name: tensor.numpy() for name, tensor in host.items()}


#: TensorRT's data type names and Triton's.
_TRITON_TYPES = {"FLOAT": "TYPE_FP32", "HALF": "TYPE_FP16", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64",
                 "INT8": "TYPE_INT8", "BOOL": "TYPE_BOOL", "UINT8": "TYPE_UINT8"}


def _variable_axes(tensor: GraphTensor | None) -> tuple[int, ...]:
    """Axes after the batch dim whose size varies (the pass's length)."""
    if tensor is None:
        return ()
    return tuple(axis for axis, size in enumerate(tensor.shape) if axis > 0 and size is None)
