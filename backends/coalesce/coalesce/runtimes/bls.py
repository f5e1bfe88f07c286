"""BLS runtime: each forward pass goes to another Triton model (e.g. a native TensorRT or ONNX Runtime model).

Coalesce keeps reading, coalescing, caching and the task's own steps (pooling,
activations); the target model only runs the graph, with the runtime inputs the task
assembles and the outputs it asks for, by name. The Triton adapter supplies the call
(``pb_utils.InferenceRequest(...).exec()``), so this module never imports
``triton_python_backend_utils``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from coalesce.core.errors import CoalesceError, RuntimeFailure
from coalesce.core.tensors import GraphIO

#: ``call(model, version, inputs, output_names) -> outputs``: one synchronous request to a Triton model.
BlsCall = Callable[[str, str, Mapping[str, np.ndarray], Sequence[str]], Mapping[str, np.ndarray]]


class BlsRuntime:
    """Runs each padded pass on the Triton model ``model`` through BLS."""

    name = "bls"

    def __init__(self, call: BlsCall, model: str, *, version: str = "") -> None:
        """Call ``model`` (``version``; empty: the server's policy).

        Triton 2.51 allows BLS only inside ``execute``, so the target is not probed here:
        a missing or mismatched target fails the requests of its passes, with a message
        naming it, and the model stays loaded for when the target appears.
        """
        self._call = call
        self.model = model
        self.version = version
        #: Unknown until the target answers: tasks check its outputs pass by pass.
        self.graph: GraphIO | None = None

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """Send one padded pass to the target model; return its named ``outputs``.

        Raises:
            RuntimeFailure: If the target answers with an error, without an output, or with one that is not per row.
        """
        try:
            results = self._call(self.model, self.version, feeds, outputs)
        except CoalesceError:
            raise
        except Exception as exc:
            raise RuntimeFailure(f"BLS request to '{self.model}' failed: {exc}") from exc
        rows = len(next(iter(feeds.values())))
        out: dict[str, np.ndarray] = {}
        for name in outputs:
            value = results.get(name)
            if value is None:
                raise RuntimeFailure(f"BLS target '{self.model}' returned no '{name}' (got {sorted(results)})")
            value = np.asarray(value)
            if value.ndim == 0 or value.shape[0] != rows:
                raise RuntimeFailure(f"BLS target '{self.model}' returned '{name}' of shape {list(value.shape)} for "
                                     f"a pass of {rows} rows")
            out[name] = value
        return out
