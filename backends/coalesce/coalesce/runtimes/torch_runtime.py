"""torch runtime: a Hugging Face model folder (the text tasks' weights) on the CPU or a CUDA device.

Loads the folder that ``coalesce export`` writes beside the ONNX graph (``config.json``
and ``model.safetensors``): with the ``base`` head it returns token states
(``last_hidden_state``), with ``sequence-classification`` the ``logits``. On CUDA it can
run in FP16 and replay CUDA graphs captured for fixed ``(rows, length)`` buckets: a
pass is padded up to the smallest bucket that holds it (padding is masked out, so
results do not change) and replayed without per-kernel launch cost.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from coalesce.core.errors import ConfigError, RuntimeFailure
from coalesce.core.tensors import GraphIO, GraphTensor

#: What each head returns: (output name, attribute of the model's output).
HEADS: Final = {"base": "last_hidden_state", "sequence-classification": "logits"}
_TEXT_INPUTS: Final = ("input_ids", "attention_mask", "token_type_ids")
#: Weight files that are Python pickles: loading one can run any code it carries, so they are refused.
PICKLE_SUFFIXES: Final = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def check_safetensors(model_dir: Path) -> None:
    """Make sure the weights in ``model_dir`` are safetensors, the only form the torch runtime loads.

    ``torch.load`` unpickles, and a pickle can run code at load even with
    ``weights_only=True`` (it narrows, not removes, what the unpickler accepts).

    Raises:
        ConfigError: If the folder holds no ``*.safetensors`` file, naming the pickles it holds instead.
    """
    if any(model_dir.glob("*.safetensors")):
        return
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES) if model_dir.is_dir() else []
    found = f"it holds pickled weights {pickles}, which are never loaded" if pickles else "it holds none"
    raise ConfigError(f"torch runtime: weights in {model_dir} must be safetensors (model.safetensors); {found}. "
                      "Convert them (`coalesce export` writes safetensors)")


class TorchRuntime:
    """A ``transformers`` model under ``torch.inference_mode``."""

    name = "torch"

    def __init__(self, model_dir: Path, *, head: str = "base", device: str = "cpu", precision: str = "fp32",
                 cuda_graph_buckets: Sequence[tuple[int, int]] = (), threads: int = 0) -> None:
        """Load the weights onto ``device``; capture CUDA graphs for ``cuda_graph_buckets`` (CUDA only).

        Raises:
            ConfigError: If the weights are missing, the head is unknown, or FP16 / CUDA graphs are asked for on a CPU.
        """
        import torch
        from transformers import AutoModel, AutoModelForSequenceClassification

        if head not in HEADS:
            raise ConfigError(f"torch runtime: unknown head '{head}', expected one of {', '.join(HEADS)}")
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"torch runtime: no weights at {model_dir} (run `coalesce export`)")
        check_safetensors(model_dir)
        if device == "cpu" and (precision != "fp32" or cuda_graph_buckets):
            raise ConfigError("torch runtime: fp16 and CUDA graphs need a CUDA device")
        if threads and device == "cpu":
            torch.set_num_threads(threads)
        self._torch = torch
        self.device = torch.device(device)
        self.dtype = torch.float16 if precision == "fp16" else torch.float32
        self._output = HEADS[head]
        loader = AutoModel if head == "base" else AutoModelForSequenceClassification
        kwargs = {"add_pooling_layer": False} if head == "base" else {}
        try:
            model = loader.from_pretrained(str(model_dir), use_safetensors=True, **kwargs)
        except TypeError:  # an architecture without a pooling layer to leave out
            model = loader.from_pretrained(str(model_dir), use_safetensors=True)
        self._model = model.eval().to(device=self.device, dtype=self.dtype)
        accepted = inspect.signature(self._model.forward).parameters
        self._inputs = tuple(name for name in _TEXT_INPUTS if name in accepted)
        width = int(model.config.hidden_size if head == "base" else model.config.num_labels)
        shape: tuple[int | None, ...] = (None, None, width) if head == "base" else (None, width)
        self.graph = GraphIO(inputs=tuple(GraphTensor(n, "TYPE_INT64", (None, None)) for n in self._inputs),
                             outputs=(GraphTensor(self._output, "TYPE_FP32", shape),))
        self._graphs: dict[tuple[int, int], tuple[Any, dict[str, Any], Any]] = {}
        self._buckets = sorted(cuda_graph_buckets)
        for rows, length in self._buckets:
            self._capture(rows, length)

    def _forward(self, feeds: Mapping[str, Any]) -> Any:
        return getattr(self._model(**feeds), self._output)

    def _capture(self, rows: int, length: int) -> None:
        torch = self._torch
        static = {k: torch.ones((rows, length), dtype=torch.int64, device=self.device) for k in self._inputs}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up on a side stream, as CUDA graph capture requires
                self._forward(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            out = self._forward(static)
        self._graphs[(rows, length)] = (graph, static, out)

    def _bucket(self, rows: int, length: int) -> tuple[int, int] | None:
        """The smallest captured bucket holding ``rows`` x ``length``, or None."""
        fits = [b for b in self._buckets if b[0] >= rows and b[1] >= length]
        return min(fits, key=lambda b: b[0] * b[1]) if fits else None

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one padded pass; return its output as float32 numpy.

        Raises:
            RuntimeFailure: If torch fails on this pass (e.g. out of memory) or an unknown output is asked for.
        """
        torch = self._torch
        unknown = [name for name in outputs if name != self._output]
        if unknown:
            raise RuntimeFailure(f"torch runtime gives only '{self._output}', not {unknown}")
        rows, length = feeds[self._inputs[0]].shape
        try:
            bucket = self._bucket(rows, length) if self._graphs else None
            if bucket is not None:
                graph, static, out = self._graphs[bucket]
                for name in self._inputs:
                    static[name].zero_()
                    static[name][:rows, :length].copy_(torch.from_numpy(feeds[name]))
                graph.replay()
                result = out[:rows, :length] if out.ndim == 3 else out[:rows]
            else:
                with torch.inference_mode():
                    result = self._forward({name: torch.from_numpy(feeds[name]).to(self.device)
                                            for name in self._inputs})
            return {self._output: result.float().cpu().numpy()}
        except RuntimeError as exc:
            raise RuntimeFailure(f"torch failed on a pass of shape {[rows, length]}: {exc}") from exc


def buckets_from(rows: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Every (rows, length) pair of the given row and length buckets, sorted."""
    return sorted({(r, n) for r in rows for n in lengths})
