"""The task interface: all that the planner, row cache, de-duplication, scheduler and metrics know of a model kind.

A task turns a request's tensors into rows, says what a row costs (its length in
positions: tokens for text, the variable dim for tensors, 1 for fixed shapes), pads a
planned pass of rows into the runtime's named inputs, turns the runtime's named outputs
back into the model's outputs per row, and gives each row's canonical bytes for cache
keys and de-duplication. Nothing outside ``coalesce.tasks`` knows what a row holds.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from coalesce.core.errors import ConfigError
from coalesce.core.tensors import GraphIO, TensorSpec
from coalesce.settings import ModelSettings, inside_version_folder

#: One row of a request, in the task's own form (a text, a text pair, one row of each input tensor).
Row = Any


class Prepared(Protocol):
    """Rows made ready to be padded into passes (e.g. tokenised), with each row's length."""

    @property
    def lengths(self) -> np.ndarray:
        """Length of each row in positions (>= 1), in the order the rows were given."""
        ...


@dataclasses.dataclass(frozen=True)
class Pass:
    """One planned forward pass: rows ``indices`` of ``prepared``, padded to ``padded_length`` into ``feeds``."""

    prepared: Prepared
    indices: np.ndarray
    padded_length: int
    feeds: dict[str, np.ndarray]

    @property
    def lengths(self) -> np.ndarray:
        """Each row's own length, in pass order."""
        return self.prepared.lengths[self.indices]


class Task(abc.ABC):
    """One model kind behind the coalescing pipeline.

    Attributes:
        name: The task's name (parameter ``task``).
        torch_head: What the torch runtime loads for this task (``base`` for token states,
            ``sequence-classification`` for logits), or None where torch does not apply.
        inputs: The model's inputs as Triton sees them (``config.pbtxt``).
        outputs: The model's outputs per row; a ``-1`` dim follows the row's length and is cut
            back to it after each pass.
        graph_outputs: The runtime outputs each pass asks for.
        max_length: Longest row, in positions (1 for models of fixed shape).
        graph_rows_per_row: Rows of the runtime's feeds (dim 0) one row of the task takes: 1, or 2
            where a row is two texts encoded apart (``similarity``). Row limits of the runtime (a
            TensorRT profile's) are divided by it; calibration feeds passes of as many graph rows.
    """

    name: ClassVar[str]
    torch_head: ClassVar[str | None] = None
    graph_rows_per_row: ClassVar[int] = 1

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    graph_outputs: tuple[str, ...]
    max_length: int

    @abc.abstractmethod
    def __init__(self, settings: ModelSettings, config: Mapping[str, Any], version_dir: Path) -> None:
        """Check the model's ``config`` (JSON form) against the task's contract; load its files from ``version_dir``.

        Raises:
            ConfigError: Naming the model, the tensor or file, and what does not fit.
        """

    @abc.abstractmethod
    def read(self, tensors: Mapping[str, np.ndarray]) -> list[Row]:
        """One request's rows from its input tensors (the request's inputs by name; absent optional ones left out).

        Raises:
            InvalidInputError: Naming the tensor and what is wrong with it.
        """

    @abc.abstractmethod
    def row_bytes(self, row: Row) -> bytes:
        """The row's canonical bytes: equal exactly for rows that give equal outputs by construction."""

    @abc.abstractmethod
    def lengths(self, rows: Sequence[Row]) -> np.ndarray:
        """Each row's length in positions, without keeping anything (admission uses it)."""

    @abc.abstractmethod
    def prepare(self, rows: Sequence[Row]) -> Prepared:
        """Make rows ready to be assembled into passes (one batched call: e.g. tokenise them all)."""

    @abc.abstractmethod
    def assemble(self, prepared: Prepared, indices: np.ndarray, padded_length: int) -> dict[str, np.ndarray]:
        """The runtime's named inputs for a pass over rows ``indices`` of ``prepared``, padded to ``padded_length``."""

    @abc.abstractmethod
    def split(self, batch: Pass, results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs for one pass, from the runtime's ``results``: ``[rows, ...]`` per output.

        Outputs whose dims follow the row's length come back padded to the pass's length;
        the pipeline cuts each row back to its own.
        """

    @abc.abstractmethod
    def synthetic_feeds(self, rows: int, length: int) -> dict[str, np.ndarray]:
        """Inputs of a representative pass of ``rows`` rows of ``length`` positions (for timing at load)."""

    @abc.abstractmethod
    def bind(self, graph: GraphIO | None) -> None:
        """Check the runtime's graph against the task's contract at load, and learn what to feed it.

        ``graph`` is None where the runtime cannot describe its graph before running it (BLS).

        Raises:
            ConfigError: Naming the model, the tensor and what does not fit.
        """

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """Everything of the task that decides its outputs (settings, digests of its files), for cache keys."""

    def guarded_task(self) -> Task:
        """The task whose one output the INT8 accuracy guard compares between graphs, on single texts.

        The task itself by default; a task whose rows are not single texts gives the one its
        vectors come from (``similarity``: the embedding of each text).

        Raises:
            ConfigError: If the task cannot give one (it was not bound to a graph it can read).
        """
        return self

    def unit_norm_outputs(self) -> frozenset[str]:
        """The outputs the task L2-normalises: each vector along their last axis has norm 1.

        A cache may refuse a stored value of these outputs that is not; none by default.
        """
        return frozenset()

    @classmethod
    def complete(cls, config: Mapping[str, Any], graph: GraphIO | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """What auto-completion adds to a config: (inputs, outputs), each only where the config declares none.

        ``graph`` is the version's ONNX graph where one could be read, else None.
        """
        return [], []


def version_file(version_dir: Path, name: str) -> Path:
    """A file of the model's version folder, named by a setting: a relative path that stays inside it.

    Raises:
        ConfigError: If ``name`` is absolute or climbs out with ``..`` (settings refuse those at parse
            time; this holds for every caller).
    """
    why = inside_version_folder(name)
    if why:
        raise ConfigError(f"file '{name}': {why}")
    return version_dir / name
