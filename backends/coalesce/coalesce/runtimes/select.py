"""Which runtime a model gets: what the machine offers, and a pure choice over it.

``probe`` looks at the machine once (a GPU through torch or the NVIDIA driver's
library, the ``tensorrt`` module, ONNX Runtime's execution providers); ``choose`` is a
pure function of that, the setting and the files in the version folder, so every
branch of the choice, and every error message, is tested on a CPU-only machine.

``auto`` prefers, in order: a TensorRT engine (a plan file, the ``tensorrt`` module and
a GPU), ONNX Runtime on the GPU (``onnxruntime-gpu``'s TensorRT or CUDA provider),
torch on CUDA, then ONNX Runtime on the CPU; the reason names why each better one was
passed over. An explicit runtime that cannot run fails the load, saying what is missing.
"""

from __future__ import annotations

import ctypes.util
import dataclasses
import importlib.util
from pathlib import Path
from typing import Final

from coalesce.core.errors import ConfigError
from coalesce.settings import RUNTIME_CHOICES

#: ONNX Runtime's GPU execution providers, best first.
ORT_GPU_PROVIDERS: Final = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What this machine and Python environment can run.

    Attributes:
        gpu: An NVIDIA GPU is usable (and why not, when it is not).
        tensorrt_version: The ``tensorrt`` module's version, or None.
        ort_providers: ONNX Runtime's available execution providers.
        torch_cuda: torch is importable and sees a CUDA device.
        torch: torch (and transformers) are importable.
    """

    gpu: bool
    gpu_reason: str
    tensorrt_version: str | None
    ort_providers: tuple[str, ...]
    torch_cuda: bool
    torch: bool


def probe() -> Capabilities:
    """Look at this machine once: GPU, TensorRT, ONNX Runtime providers, torch."""
    torch_ok = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
    torch_cuda = False
    if torch_ok:
        import torch

        torch_cuda = bool(torch.cuda.is_available())
    driver = ctypes.util.find_library("nvidia-ml") or ctypes.util.find_library("cuda")
    gpu = torch_cuda or driver is not None
    reason = ("torch sees a CUDA device" if torch_cuda else
              f"NVIDIA driver library found ({driver})" if driver else "no NVIDIA driver library and no CUDA device")
    tensorrt_version = None
    if importlib.util.find_spec("tensorrt") is not None:
        import tensorrt

        tensorrt_version = str(tensorrt.__version__)
    import onnxruntime

    return Capabilities(gpu=gpu, gpu_reason=reason, tensorrt_version=tensorrt_version,
                        ort_providers=tuple(onnxruntime.get_available_providers()), torch_cuda=torch_cuda,
                        torch=torch_ok)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The runtime chosen, the device it runs on, and why (for the load log)."""

    runtime: str
    device: str
    reason: str
    providers: tuple[str, ...] = ()


def choose(requested: str, caps: Capabilities, *, engine_path: Path, torch_model_dir: Path,
           instance_kind: str = "CPU", model_name: str = "model", bls_model: str = "",
           torch_applies: bool = True, task: str = "embedding") -> Choice:
    """Pick the runtime for ``requested`` on a machine with ``caps``.

    ``instance_kind`` is Triton's instance kind (``CPU`` or ``GPU``): a ``KIND_CPU``
    instance never gets a GPU runtime from ``auto``. ``torch_applies`` says whether the
    model's ``task`` can run on the torch runtime (it loads Hugging Face text models).

    Raises:
        ConfigError: If an explicit runtime cannot run here; the message says what is missing.
    """
    where = f"model '{model_name}'"
    gpu_ok = caps.gpu and instance_kind.upper() != "CPU"
    gpu_why = caps.gpu_reason if not caps.gpu else "the instance is KIND_CPU"
    ort_gpu = tuple(p for p in ORT_GPU_PROVIDERS if p in caps.ort_providers)

    def tensorrt_missing() -> str | None:
        if not engine_path.is_file():
            return f"no engine at {engine_path} (build one with `coalesce build-engine`)"
        if caps.tensorrt_version is None:
            return "the 'tensorrt' module is not installed (pip install 'coalesce[gpu]')"
        if not gpu_ok:
            return f"no GPU ({gpu_why})"
        return None

    def torch_missing(cuda: bool) -> str | None:
        if not torch_applies:
            return f"it does not apply to task '{task}' (it loads Hugging Face text models)"
        if not caps.torch:
            return "torch and transformers are not installed (pip install 'coalesce[gpu]', or the dev extra on a CPU)"
        if not (torch_model_dir / "config.json").is_file():
            return f"no weights at {torch_model_dir} (`coalesce export` writes them)"
        if cuda and not (caps.torch_cuda and gpu_ok):
            why = gpu_why if not gpu_ok else "torch.cuda.is_available() is False"
            return f"torch sees no usable CUDA device ({why})"
        return None

    if requested == "tensorrt":
        missing = tensorrt_missing()
        if missing:
            raise ConfigError(f"{where}: runtime 'tensorrt' is not available: {missing}")
        return Choice("tensorrt", "cuda", f"runtime 'tensorrt' asked for; TensorRT {caps.tensorrt_version}")
    if requested == "torch":
        cuda = gpu_ok and caps.torch_cuda
        missing = torch_missing(cuda)
        if missing:
            raise ConfigError(f"{where}: runtime 'torch' is not available: {missing}")
        return Choice("torch", "cuda" if cuda else "cpu", f"runtime 'torch' asked for; on {'CUDA' if cuda else 'CPU'}")
    if requested == "onnxruntime":
        if gpu_ok and ort_gpu:
            return Choice("onnxruntime", "cuda", f"runtime 'onnxruntime' asked for; providers {list(ort_gpu)}",
                          (*ort_gpu, "CPUExecutionProvider"))
        return Choice("onnxruntime", "cpu", "runtime 'onnxruntime' asked for; on CPU", ("CPUExecutionProvider",))
    if requested == "bls":
        if not bls_model:
            raise ConfigError(f"{where}: runtime 'bls' needs parameter 'bls_model' (the Triton model to call)")
        return Choice("bls", "server", f"runtime 'bls' asked for; each pass goes to Triton model '{bls_model}'")
    if requested != "auto":
        raise ConfigError(f"{where}: runtime '{requested}' is unknown; choose one of {', '.join(RUNTIME_CHOICES)}")

    passed: list[str] = []
    missing = tensorrt_missing()
    if missing is None:
        return Choice("tensorrt", "cuda", f"runtime 'auto': TensorRT {caps.tensorrt_version} engine {engine_path.name}")
    passed.append(f"TensorRT: {missing}")
    if gpu_ok and ort_gpu:
        return Choice("onnxruntime", "cuda", f"runtime 'auto': ONNX Runtime on the GPU, providers {list(ort_gpu)} "
                      f"(passed over {'; '.join(passed)})", (*ort_gpu, "CPUExecutionProvider"))
    passed.append("ONNX Runtime GPU: " + (f"no GPU ({gpu_why})" if not gpu_ok else
                                          "onnxruntime-gpu is not installed (no CUDA or TensorRT provider)"))
    missing = torch_missing(cuda=True)
    if missing is None:
        return Choice("torch", "cuda", f"runtime 'auto': torch on CUDA (passed over {'; '.join(passed)})")
    passed.append(f"torch CUDA: {missing}")
    return Choice("onnxruntime", "cpu", f"runtime 'auto': ONNX Runtime on CPU (passed over {'; '.join(passed)})",
                  ("CPUExecutionProvider",))
