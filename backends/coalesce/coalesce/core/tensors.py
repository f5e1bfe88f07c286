"""Named tensors as a model config declares them, and the data types Triton, numpy and ONNX use for them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np

from coalesce.core.errors import ConfigError

#: Triton config data types and their numpy types (``TYPE_STRING`` rows are Python ``bytes`` objects).
TRITON_TO_NUMPY: Final[Mapping[str, Any]] = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
#: ONNX Runtime's type strings (``NodeArg.type``) and Triton's config data types.
ONNX_TO_TRITON: Final[Mapping[str, str]] = {
    "tensor(bool)": "TYPE_BOOL", "tensor(uint8)": "TYPE_UINT8", "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32", "tensor(uint64)": "TYPE_UINT64", "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16", "tensor(int32)": "TYPE_INT32", "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16", "tensor(float)": "TYPE_FP32", "tensor(double)": "TYPE_FP64",
    "tensor(string)": "TYPE_STRING",
}
#: A dim whose size varies per request (Triton's ``-1``).
VARIABLE: Final = -1


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model, per row (the batch dim is not part of ``dims``).

    Attributes:
        name: Tensor name, as in ``config.pbtxt`` and requests.
        data_type: Triton's config data type (``TYPE_FP32``...).
        dims: Size of each dim of one row; ``VARIABLE`` (-1) varies per request and, for an
            output of the ``tensor`` task, follows the row's length.
        optional: A request may leave this input out.
    """

    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the tensor's values."""
        return np.dtype(TRITON_TO_NUMPY[self.data_type])

    @property
    def variable_axes(self) -> tuple[int, ...]:
        """Positions in ``dims`` that vary per request."""
        return tuple(i for i, d in enumerate(self.dims) if d == VARIABLE)

    def row_shape(self, length: int) -> tuple[int, ...]:
        """Shape of one row whose variable dims are ``length`` long."""
        return tuple(length if d == VARIABLE else d for d in self.dims)

    def as_config(self) -> dict[str, Any]:
        """The entry ``config.pbtxt`` (JSON form) would hold for it."""
        entry: dict[str, Any] = {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}
        if self.optional:
            entry["optional"] = True
        return entry

    @classmethod
    def from_config(cls, entry: Mapping[str, Any], *, model_name: str) -> TensorSpec:
        """Read one ``input``/``output`` entry of a model config (JSON form).

        Raises:
            ConfigError: If the data type is not one Triton knows.
        """
        data_type = str(entry.get("data_type", ""))
        if data_type not in TRITON_TO_NUMPY:
            raise ConfigError(f"model '{model_name}': tensor '{entry.get('name')}' has data_type '{data_type}', "
                              f"expected one of {', '.join(TRITON_TO_NUMPY)}")
        return cls(name=str(entry.get("name", "")), data_type=data_type,
                   dims=tuple(int(d) for d in entry.get("dims", [])), optional=bool(entry.get("optional", False)))


def config_tensors(config: Mapping[str, Any], kind: str, *, model_name: str) -> list[TensorSpec]:
    """Every ``kind`` (``input`` or ``output``) tensor a model config declares, in order."""
    return [TensorSpec.from_config(entry, model_name=model_name) for entry in config.get(kind, []) or []]


def check_declared(model_name: str, kind: str, declared: Sequence[TensorSpec], expected: Sequence[TensorSpec]) -> None:
    """Check that a config declares exactly the ``expected`` tensors (names, data types, dims).

    Raises:
        ConfigError: Naming the model, the tensor and what differs.
    """
    names = sorted(t.name for t in declared)
    wanted = sorted(t.name for t in expected)
    if names != wanted:
        raise ConfigError(f"model '{model_name}': expected {kind}s {wanted}, found {names}")
    by_name = {t.name: t for t in declared}
    for want in expected:
        got = by_name[want.name]
        if got.data_type != want.data_type:
            raise ConfigError(f"model '{model_name}': {kind} '{want.name}' has data_type '{got.data_type}', "
                              f"expected '{want.data_type}'")
        if got.dims != want.dims:
            raise ConfigError(f"model '{model_name}': {kind} '{want.name}' has dims {list(got.dims)}, "
                              f"expected {list(want.dims)}")


@dataclasses.dataclass(frozen=True)
class GraphTensor:
    """One input or output of a runtime's graph, as the runtime reports it.

    Attributes:
        name: The graph's tensor name.
        data_type: Triton's data type of its values, or None where the runtime cannot say.
        shape: Every dim, the batch dim included: an int where fixed, None where dynamic.
    """

    name: str
    data_type: str | None
    shape: tuple[int | None, ...]


@dataclasses.dataclass(frozen=True)
class GraphIO:
    """What a runtime's graph takes and gives; None where the runtime cannot know before it runs (BLS)."""

    inputs: tuple[GraphTensor, ...]
    outputs: tuple[GraphTensor, ...]

    def input(self, name: str) -> GraphTensor | None:
        """The input called ``name``, or None."""
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> GraphTensor | None:
        """The output called ``name``, or None."""
        return next((t for t in self.outputs if t.name == name), None)
