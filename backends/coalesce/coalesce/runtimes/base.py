"""The runtime interface every engine implements, and creating the one a model asks for.

A runtime runs one padded pass of named input tensors and returns the named outputs
asked for; reading, tokenising, coalescing, caching and the task's own steps (pooling,
activations) stay outside, so every runtime (ONNX Runtime on CPU or GPU, TensorRT,
torch, or another Triton model through BLS) gets them for free, for every task.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from coalesce.core.errors import ConfigError
from coalesce.core.task import Task, version_file
from coalesce.core.tensors import GraphIO
from coalesce.runtimes.bls import BlsCall
from coalesce.runtimes.select import Capabilities, choose, probe
from coalesce.settings import ModelSettings


class Runtime(Protocol):
    """Runs a graph on one padded pass: named tensors in, named tensors out."""

    name: str

    @property
    def graph(self) -> GraphIO | None:
        """The graph's inputs and outputs, or None where the runtime cannot know them before it runs."""
        ...

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one pass over ``feeds`` (rows on dim 0); return ``outputs`` by name, on the host.

        Raises:
            RuntimeFailure: If the pass fails; only the requests with rows in it fail.
        """
        ...


@dataclasses.dataclass(frozen=True)
class RuntimeChoice:
    """The runtime picked for a model and the reason, for the load log."""

    runtime: Runtime
    reason: str


def create_runtime(settings: ModelSettings, task: Task, version_dir: Path, *, instance_kind: str = "CPU",
                   device_id: int = 0, bls_call: BlsCall | None = None,
                   caps: Capabilities | None = None) -> RuntimeChoice:
    """Create the runtime the settings ask for, on the device Triton gave the instance.

    Raises:
        ConfigError: If the asked runtime, its files or its packages are unavailable, or it does not apply to the task.
    """
    options = settings.runtime
    if options.precision == "int8":
        # The INT8 graphs (MatMulNBits or MatMulInteger, coalesce_tools.quantize) are ONNX Runtime CPU kernels;
        # a GPU has fp16.
        from coalesce.runtimes.onnx import OnnxRuntime

        int8_path = version_file(version_dir, options.int8_onnx_file)
        if not int8_path.is_file():
            raise ConfigError(f"model '{settings.model_name}': precision int8 needs the quantised graph {int8_path}; "
                              "make it with `coalesce export --int8` (the example models' recipes do), or set "
                              "precision fp32")
        onnx = OnnxRuntime.from_options(int8_path, options)
        return RuntimeChoice(runtime=onnx, reason=f"precision int8: ONNX Runtime on the CPU runs "
                             f"{options.int8_onnx_file}; providers {onnx.providers}")
    caps = caps if caps is not None else probe()
    engine_path = version_file(version_dir, options.engine_file)
    torch_dir = version_file(version_dir, options.torch_model_dir)
    choice = choose(options.runtime, caps, engine_path=engine_path, torch_model_dir=torch_dir,
                    instance_kind=instance_kind, model_name=settings.model_name, bls_model=options.bls_model,
                    torch_applies=task.torch_head is not None, task=task.name)
    if choice.runtime == "onnxruntime":
        from coalesce.runtimes.onnx import OnnxRuntime

        onnx = OnnxRuntime.from_options(version_file(version_dir, options.onnx_file), options,
                                        providers=choice.providers, device_id=device_id)
        return RuntimeChoice(runtime=onnx, reason=choice.reason + f"; providers {onnx.providers}")
    if choice.runtime == "torch":
        from coalesce.runtimes.torch_runtime import TorchRuntime, buckets_from

        assert task.torch_head is not None  # choose() refuses torch for a task it does not apply to
        device = f"cuda:{device_id}" if choice.device == "cuda" else "cpu"
        if options.cuda_graphs and choice.device != "cuda":
            raise ConfigError(f"model '{settings.model_name}': cuda_graphs needs torch on CUDA; {choice.reason}")
        rows = settings.planner.max_batch_rows * task.graph_rows_per_row  # graph rows: a pair feeds two texts
        buckets = (buckets_from(rows=sorted({1, 8, min(32, rows), rows}),
                                lengths=sorted({min(n, task.max_length) for n in (32, 64, 128, task.max_length)}))
                   if options.cuda_graphs else ())
        torch_runtime = TorchRuntime(torch_dir, head=task.torch_head, device=device,
                                     precision=options.precision if choice.device == "cuda" else "fp32",
                                     cuda_graph_buckets=buckets, threads=options.intra_op_threads)
        return RuntimeChoice(runtime=torch_runtime, reason=choice.reason + f"; {device}, {torch_runtime.dtype}"
                             + (f", CUDA graphs for {len(buckets)} buckets" if buckets else ""))
    if choice.runtime == "tensorrt":
        from coalesce.runtimes.tensorrt import TensorRTRuntime

        engine = TensorRTRuntime(engine_path, device_id=device_id)
        return RuntimeChoice(runtime=engine, reason=choice.reason + f"; profiles {engine.profiles}")
    if choice.runtime == "bls":
        if bls_call is None:
            raise ConfigError(f"model '{settings.model_name}': runtime 'bls' only runs inside Triton")
        from coalesce.runtimes.bls import BlsRuntime

        return RuntimeChoice(runtime=BlsRuntime(bls_call, options.bls_model, version=options.bls_model_version),
                             reason=choice.reason)
    raise ConfigError(f"model '{settings.model_name}': runtime '{choice.runtime}' is not built in")
