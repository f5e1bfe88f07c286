"""torch runtime: the same weights as the ONNX graph, on the CPU or a CUDA device.

Loads the Hugging Face folder that ``coalesce export`` writes beside the ONNX graph
(``config.json`` and ``model.safetensors`` of the packaged all-MiniLM-L6-v2). On CUDA it
can run in FP16 and replay CUDA graphs captured for fixed ``(rows, length)`` buckets:
a sub-batch is padded up to the smallest bucket that holds it (padding is masked out,
so results do not change) and replayed without per-kernel launch cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coalesce.errors import ConfigError, RuntimeFailure


class TorchRuntime:
    """A ``transformers`` BERT encoder under ``torch.inference_mode``."""

    name = "torch"

    def __init__(self, model_dir: Path, *, device: str = "cpu", precision: str = "fp32",
                 cuda_graph_buckets: Sequence[tuple[int, int]] = (), threads: int = 0) -> None:
        """Load the weights onto ``device``; capture CUDA graphs for ``cuda_graph_buckets`` (CUDA only).

        Raises:
            ConfigError: If the weights are missing, or FP16 / CUDA graphs are asked for on a CPU.
        """
        import torch
        from transformers import BertModel

        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"torch runtime: no weights at {model_dir} (run `coalesce export`)")
        if device == "cpu" and (precision != "fp32" or cuda_graph_buckets):
            raise ConfigError("torch runtime: fp16 and CUDA graphs need a CUDA device")
        if threads and device == "cpu":
            torch.set_num_threads(threads)
        self._torch = torch
        self.device = torch.device(device)
        self.dtype = torch.float16 if precision == "fp16" else torch.float32
        model = BertModel.from_pretrained(str(model_dir), add_pooling_layer=False)
        self._model = model.eval().to(device=self.device, dtype=self.dtype)
        self._hidden_size = int(model.config.hidden_size)
        self._graphs: dict[tuple[int, int], tuple[Any, dict[str, Any], Any]] = {}
        self._buckets = sorted(cuda_graph_buckets)
        for rows, length in self._buckets:
            self._capture(rows, length)

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states."""
        return self._hidden_size

    def _capture(self, rows: int, length: int) -> None:
        torch = self._torch
        static = {k: torch.ones((rows, length), dtype=torch.int64, device=self.device)
                  for k in ("input_ids", "attention_mask", "token_type_ids")}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up on a side stream, as CUDA graph capture requires
                self._model(**static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.inference_mode():
            out = self._model(**static).last_hidden_state
        self._graphs[(rows, length)] = (graph, static, out)

    def _bucket(self, rows: int, length: int) -> tuple[int, int] | None:
        """The smallest captured bucket holding ``rows`` x ``length``, or None."""
        fits = [b for b in self._buckets if b[0] >= rows and b[1] >= length]
        return min(fits, key=lambda b: b[0] * b[1]) if fits else None

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            token_type_ids: np.ndarray) -> np.ndarray:
        """Run one padded sub-batch; return ``last_hidden_state`` as float32 numpy.

        Raises:
            RuntimeFailure: If torch fails on this batch (e.g. out of memory).
        """
        torch = self._torch
        rows, length = input_ids.shape
        try:
            bucket = self._bucket(rows, length) if self._graphs else None
            if bucket is not None:
                graph, static, out = self._graphs[bucket]
                for name, array in (("input_ids", input_ids), ("attention_mask", attention_mask),
                                    ("token_type_ids", token_type_ids)):
                    static[name].zero_()
                    static[name][:rows, :length].copy_(torch.from_numpy(array))
                graph.replay()
                hidden = out[:rows, :length]
            else:
                with torch.inference_mode():
                    hidden = self._model(
                        input_ids=torch.from_numpy(input_ids).to(self.device),
                        attention_mask=torch.from_numpy(attention_mask).to(self.device),
                        token_type_ids=torch.from_numpy(token_type_ids).to(self.device)).last_hidden_state
            return hidden.float().cpu().numpy()
        except RuntimeError as exc:
            raise RuntimeFailure(f"torch failed on a batch of shape {input_ids.shape}: {exc}") from exc


def buckets_from(rows: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Every (rows, length) pair of the given row and length buckets, sorted."""
    return sorted({(r, n) for r in rows for n in lengths})



