"""Baseline ``naive``: the common tutorial Python-backend model.

Loops over the requests Triton's dynamic batcher hands it and runs one forward pass
per request (padded to that request's longest text), with the same ONNX file and
tokenizer as ``minilm``. It is what a user writes without Coalesce.
"""

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


class TritonPythonModel:
    """One forward pass per request."""

    def initialize(self, args: dict[str, str]) -> None:
        """Load tokenizer and ONNX session from the version folder."""
        folder = Path(args["model_repository"]) / args["model_version"]
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_length=256)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # pad to the request's longest text
        self.session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
        self.config = json.loads(args["model_config"])

    def execute(self, requests: list[Any]) -> list[Any]:
        """Embed each request on its own."""
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()[:, 0]
            try:
                encodings = self.tokenizer.encode_batch([t.decode("utf-8") for t in texts])
            except UnicodeDecodeError as exc:
                error = pb_utils.TritonError(f"TEXT is not UTF-8: {exc}", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            ids = np.array([e.ids for e in encodings], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
            hidden = self.session.run(None, {"input_ids": ids, "attention_mask": mask,
                                             "token_type_ids": np.zeros_like(ids)})[0]
            weights = mask[:, :, None].astype(np.float32)
            pooled = (hidden * weights).sum(1) / np.clip(weights.sum(1), 1e-9, None)
            pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("EMBEDDING", pooled.astype(np.float32))]))
        return responses
