"""BLS runtime: each forward pass goes to another Triton model (e.g. a native TensorRT or ONNX Runtime model).

Coalesce keeps tokenisation, coalescing, caching and pooling; the target model only
runs the encoder graph: inputs ``input_ids``, ``attention_mask``, ``token_type_ids``
(INT64, ``[rows, tokens]``) and output ``last_hidden_state`` (FP32, ``[rows, tokens,
hidden]``). The Triton adapter supplies the call (``pb_utils.InferenceRequest(...).exec()``),
so this module never imports ``triton_python_backend_utils``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from coalesce import contract
from coalesce.errors import CoalesceError, RuntimeFailure

#: ``infer(model, version, inputs) -> outputs``: one synchronous request to a Triton model.
BlsCall = Callable[[str, str, Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]


class BlsRuntime:
    """Runs each padded sub-batch on the Triton model ``model`` through BLS."""

    name = "bls"

    def __init__(self, call: BlsCall, model: str, *, version: str = "", hidden_size: int) -> None:
        """Call ``model`` (``version``; empty: the server's policy) whose hidden width is ``hidden_size``.

        Triton 2.51 allows BLS only inside ``execute``, so the target is not probed here:
        a missing or mismatched target fails the requests of its passes, with a message
        naming it, and the model stays loaded for when the target appears.
        """
        self._call = call
        self.model = model
        self.version = version
        self._hidden_size = hidden_size

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states."""
        return self._hidden_size

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            token_type_ids: np.ndarray) -> np.ndarray:
        """Send one padded sub-batch to the target model; return its ``last_hidden_state``.

        Raises:
            RuntimeFailure: If the target model answers with an error or without the output.
        """
        inputs = {contract.GRAPH_INPUT_IDS: input_ids, contract.GRAPH_ATTENTION_MASK: attention_mask,
                  contract.GRAPH_TOKEN_TYPE_IDS: token_type_ids}
        try:
            outputs = self._call(self.model, self.version, inputs)
        except CoalesceError:
            raise
        except Exception as exc:
            raise RuntimeFailure(f"BLS request to '{self.model}' failed: {exc}") from exc
        hidden = outputs.get(contract.GRAPH_OUTPUT_HIDDEN)
        if hidden is None:
            raise RuntimeFailure(f"BLS target '{self.model}' returned no '{contract.GRAPH_OUTPUT_HIDDEN}' "
                                 f"(got {sorted(outputs)})")
        hidden = np.asarray(hidden, dtype=np.float32)
        if hidden.ndim != 3 or hidden.shape[-1] != self._hidden_size:
            raise RuntimeFailure(f"BLS target '{self.model}' returns shape {list(hidden.shape)}, expected "
                                 f"[rows, tokens, {self._hidden_size}]")
        if hidden.shape[:2] != input_ids.shape:
            raise RuntimeFailure(f"BLS target '{self.model}' returned shape {list(hidden.shape)} for a batch of "
                                 f"{list(input_ids.shape)}")
        return hidden
