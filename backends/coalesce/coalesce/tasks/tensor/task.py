"""The ``tensor`` task: any graph whose config declares its inputs and outputs, rows on dim 0.

Config tensor names are the graph's names. A request of N rows sends every input as
``[N, *dims]``. An input with a variable dim (``-1``) is padded per pass to that pass's
longest row with its ``pad_value:<input>`` (default 0); every variable dim of a row has
the same length (its length, by which rows are sorted and passes cut). The input named
by ``mask_input`` holds the 0/1 mask of real positions: filled with ones when a request
leaves it out, padded with 0 like any input when it sends it. An output's variable dims
follow the row's length: each row's output is cut back to its own. Models of fixed shape
are stacked (every row's length is 1). A request whose tensors do not fit gets
``INVALID_ARG`` naming the tensor; its neighbours are served.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from coalesce.core.errors import ConfigError, InvalidInputError, RuntimeFailure
from coalesce.core.task import Pass, Row, Task
from coalesce.core.tensors import VARIABLE, GraphIO, TensorSpec, config_tensors
from coalesce.settings import ModelSettings


@dataclasses.dataclass(frozen=True)
class TensorRow:
    """One row: a value per model input (in the task's input order) and its length."""

    values: tuple[np.ndarray, ...]
    length: int


@dataclasses.dataclass(frozen=True)
class TensorRows:
    """Rows made ready for passes: nothing to compute ahead, only their lengths."""

    rows: Sequence[TensorRow]
    lengths: np.ndarray


class TensorTask(Task):
    """Named tensors in and out, with padding of variable dims and an optional mask filled by the backend."""

    name: ClassVar[str] = "tensor"

    def __init__(self, settings: ModelSettings, config: Mapping[str, Any], version_dir: Path) -> None:
        """Read the declared inputs and outputs and check the padding parameters against them.

        Raises:
            ConfigError: Naming the model, the tensor or parameter and what does not fit.
        """
        where = f"model '{settings.model_name}'"
        self.model_name = settings.model_name
        self.inputs = tuple(config_tensors(config, "input", model_name=self.model_name))
        self.outputs = tuple(config_tensors(config, "output", model_name=self.model_name))
        if not self.inputs or not self.outputs:
            raise ConfigError(f"{where}: task 'tensor' needs the config to declare its inputs and outputs (or an "
                              "ONNX graph in the version folder to complete them from)")
        for spec in (*self.inputs, *self.outputs):
            if spec.data_type == "TYPE_STRING":
                raise ConfigError(f"{where}: tensor '{spec.name}' is TYPE_STRING; task 'tensor' takes numeric "
                                  "tensors (texts: tasks 'embedding', 'classify' and 'similarity')")
        options = settings.tensor
        names = {spec.name for spec in self.inputs}
        variable = {spec.name for spec in self.inputs if spec.variable_axes}
        self.mask_input = options.mask_input
        if self.mask_input and self.mask_input not in variable:
            raise ConfigError(f"{where}: parameter 'mask_input' names '{self.mask_input}', which is not an input "
                              f"with a variable dim (inputs with one: {sorted(variable)})")
        for name in options.pad_values:
            if name not in names:
                raise ConfigError(f"{where}: parameter 'pad_value:{name}' names no input (inputs: {sorted(names)})")
            if name not in variable:
                raise ConfigError(f"{where}: parameter 'pad_value:{name}': input '{name}' has no variable dim to pad")
            if name == self.mask_input:
                raise ConfigError(f"{where}: parameter 'pad_value:{name}': the mask input is always padded with 0")
        for spec in self.inputs:
            if spec.optional and spec.name != self.mask_input:
                raise ConfigError(f"{where}: input '{spec.name}' is optional, but only the input named by "
                                  "'mask_input' may be left out of a request (the backend fills it)")
        self.pad_values = {spec.name: options.pad_values.get(spec.name, 0.0) for spec in self.inputs}
        self.max_length = settings.task.max_sequence_length if variable else 1
        self.graph_outputs = tuple(spec.name for spec in self.outputs)

    # -- rows -----------------------------------------------------------------------------------------

    def read(self, tensors: Mapping[str, np.ndarray]) -> list[Row]:
        """Split the request's tensors into rows, checking each against the config.

        Raises:
            InvalidInputError: Naming the tensor whose rows, dtype, dims or length do not fit.
        """
        count: int | None = None
        length: int | None = None
        length_of = ""  # the input the row length was read from
        arrays: list[np.ndarray | None] = []
        for spec in self.inputs:
            array = tensors.get(spec.name)
            if array is None:
                if spec.name != self.mask_input:
                    raise InvalidInputError(f"request has no input '{spec.name}'")
                arrays.append(None)
                continue
            if array.dtype != spec.dtype:
                raise InvalidInputError(f"input '{spec.name}' has dtype {array.dtype}, expected {spec.dtype} "
                                        f"({spec.data_type})")
            if array.ndim != len(spec.dims) + 1:
                raise InvalidInputError(f"input '{spec.name}' has shape {list(array.shape)}, expected "
                                        f"[N, {', '.join(map(str, spec.dims))}]")
            if count is None:
                count = array.shape[0]
            elif array.shape[0] != count:
                raise InvalidInputError(f"input '{spec.name}' has {array.shape[0]} rows, but the request's other "
                                        f"inputs have {count}")
            for axis, want in enumerate(spec.dims):
                got = array.shape[axis + 1]
                if want == VARIABLE:
                    if length is None:
                        length, length_of = got, spec.name
                    elif got != length:
                        raise InvalidInputError(
                            f"input '{spec.name}' has length {got} on dim {axis + 1}, but '{length_of}' has "
                            f"{length}: every variable dim of a row has the same length")
                elif got != want:
                    raise InvalidInputError(f"input '{spec.name}' has shape {list(array.shape)}, expected "
                                            f"[N, {', '.join(map(str, spec.dims))}]")
            arrays.append(array)
        if not count:
            raise InvalidInputError(f"the request has no rows: send at least one (dim 0 of '{self.inputs[0].name}')")
        if length is not None and not 1 <= length <= self.max_length:
            raise InvalidInputError(f"input '{length_of}' has rows of length {length}; the model takes 1 to "
                                    f"{self.max_length} (parameter 'max_sequence_length')")
        row_length = length if length is not None else 1
        filled = [array if array is not None else np.ones((count, *spec.row_shape(row_length)), dtype=spec.dtype)
                  for spec, array in zip(self.inputs, arrays, strict=True)]
        return [TensorRow(values=tuple(array[i] for array in filled), length=row_length) for i in range(count)]

    def row_bytes(self, row: Row) -> bytes:
        """Each input's dtype, shape and bytes, in input order."""
        parts = []
        for value in row.values:
            parts.append(f"{value.dtype.str}{value.shape}".encode("ascii"))
            parts.append(np.ascontiguousarray(value).tobytes())
        return b"\x00".join(parts)

    def lengths(self, rows: Sequence[Row]) -> np.ndarray:
        """Each row's length (1 for models of fixed shape)."""
        return np.fromiter((row.length for row in rows), dtype=np.int64, count=len(rows))

    def prepare(self, rows: Sequence[Row]) -> TensorRows:
        """Nothing to compute ahead: the rows and their lengths."""
        return TensorRows(rows=rows, lengths=self.lengths(rows))

    def assemble(self, prepared: Any, indices: np.ndarray, padded_length: int) -> dict[str, np.ndarray]:
        """Each input's rows stacked, variable dims padded to ``padded_length`` with the input's pad value."""
        rows = [prepared.rows[i] for i in indices]
        feeds: dict[str, np.ndarray] = {}
        for position, spec in enumerate(self.inputs):
            values = [row.values[position] for row in rows]
            if not spec.variable_axes or all(row.length == padded_length for row in rows):
                feeds[spec.name] = np.stack(values)
                continue
            batch = np.full((len(rows), *spec.row_shape(padded_length)), self.pad_values[spec.name],
                            dtype=spec.dtype)
            for k, (row, value) in enumerate(zip(rows, values, strict=True)):
                # Named first: mypy, targeting 3.10, reads a starred tuple inside [] as 3.11's subscript syntax.
                index = (k, *(slice(0, row.length) if d == VARIABLE else slice(None) for d in spec.dims))
                batch[index] = value
            feeds[spec.name] = batch
        return feeds

    def split(self, batch: Pass, results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The graph's outputs as they are, checked against the config (variable dims: the pass's length).

        Raises:
            RuntimeFailure: If an output's shape does not fit its config, naming the output.
        """
        rows = len(batch.indices)
        out: dict[str, np.ndarray] = {}
        for spec in self.outputs:
            value = results[spec.name]
            expected = (rows, *spec.row_shape(batch.padded_length))
            if value.shape != expected:
                raise RuntimeFailure(f"graph output '{spec.name}' has shape {list(value.shape)} for a pass of {rows} "
                                     f"rows of length {batch.padded_length}; the config's dims {list(spec.dims)} "
                                     f"say {list(expected)}")
            out[spec.name] = value if value.dtype == spec.dtype else value.astype(spec.dtype)
        return out

    def synthetic_feeds(self, rows: int, length: int) -> dict[str, np.ndarray]:
        """Each input full of its pad value (the mask full of ones) at ``rows`` x ``length``."""
        return {spec.name: np.full((rows, *spec.row_shape(length)), 1 if spec.name == self.mask_input else
                                   self.pad_values[spec.name], dtype=spec.dtype) for spec in self.inputs}

    # -- load -----------------------------------------------------------------------------------------

    def bind(self, graph: GraphIO | None) -> None:
        """Check that the graph takes and gives the declared tensors with fitting data types and dims.

        Raises:
            ConfigError: Naming the tensor that does not fit.
        """
        if graph is None:
            return
        where = f"model '{self.model_name}'"
        declared = {spec.name for spec in self.inputs}
        missing = [t.name for t in graph.inputs if t.name not in declared]
        if missing:
            raise ConfigError(f"{where}: the graph takes inputs {missing} the config does not declare")
        for kind, specs, tensors in (("input", self.inputs, graph.inputs), ("output", self.outputs, graph.outputs)):
            by_name = {t.name: t for t in tensors}
            for spec in specs:
                tensor = by_name.get(spec.name)
                if tensor is None:
                    raise ConfigError(f"{where}: {kind} '{spec.name}' is not in the graph (its {kind}s: "
                                      f"{sorted(by_name)})")
                if tensor.data_type is not None and tensor.data_type != spec.data_type:
                    raise ConfigError(f"{where}: {kind} '{spec.name}' is {spec.data_type} in the config but "
                                      f"{tensor.data_type} in the graph")
                if len(tensor.shape) != len(spec.dims) + 1 or tensor.shape[0] not in (None,):
                    raise ConfigError(f"{where}: {kind} '{spec.name}' has graph shape {list(tensor.shape)}; the "
                                      f"config's dims {list(spec.dims)} need [batch, {', '.join(map(str, spec.dims))}]"
                                      " with a dynamic batch dim")
                for size, want in zip(tensor.shape[1:], spec.dims, strict=True):
                    if size is not None and size != want:
                        raise ConfigError(f"{where}: {kind} '{spec.name}' has graph shape {list(tensor.shape)}, "
                                          f"which does not fit the config's dims {list(spec.dims)}")

    def fingerprint(self) -> dict[str, Any]:
        """The declared tensors and the padding, which decide what the graph is fed."""
        return {"task": self.name, "inputs": [spec.as_config() for spec in self.inputs],
                "outputs": [spec.as_config() for spec in self.outputs], "pad_values": self.pad_values,
                "mask_input": self.mask_input}

    @classmethod
    def complete(cls, config: Mapping[str, Any], graph: GraphIO | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The graph's inputs and outputs (batch dim dropped, symbolic dims as -1), where none are declared.

        The input named by ``mask_input`` becomes optional: the backend fills it.
        """
        if graph is None:
            return [], []
        parameters = config.get("parameters") or {}
        mask = parameters.get("mask_input", {})
        mask_name = mask.get("string_value", "") if isinstance(mask, Mapping) else str(mask)

        def specs(tensors: Sequence[Any], optional: str = "") -> list[TensorSpec]:
            out = []
            for t in tensors:
                if t.data_type is None or not t.shape or t.shape[0] is not None:
                    return []  # no dynamic batch dim or unknown type: the config must say
                out.append(TensorSpec(t.name, t.data_type, tuple(VARIABLE if d is None else d for d in t.shape[1:]),
                                      optional=t.name == optional))
            return out

        inputs = [] if config.get("input") else specs(graph.inputs, optional=mask_name)
        outputs = [] if config.get("output") else specs(graph.outputs)
        return inputs, outputs
