"""What the text tasks share: rows are UTF-8 texts (or text pairs), their length is their token count.

``TextTask`` reads ``TEXT`` (and, where the model takes pairs, ``TEXT_PAIR``), tokenises
with the model's ``tokenizer.json`` (truncated, never padded), pads each pass to its
own longest row and feeds the graph the inputs it takes of ``input_ids``,
``attention_mask`` and ``token_type_ids``. The tasks built on it add what comes out:
pooled vectors (``embedding``) or scores (``classify``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np

from coalesce.cache.keys import file_digest
from coalesce.core.errors import ConfigError, InvalidInputError, RuntimeFailure
from coalesce.core.task import Pass, Prepared, Row, Task, version_file
from coalesce.core.tensors import GraphIO, TensorSpec, check_declared, config_tensors
from coalesce.settings import ModelSettings
from coalesce.tasks.text.reading import read_texts
from coalesce.tasks.text.tokenizer import INPUT_IDS, TEXT_GRAPH_INPUTS, TextTokenizer

#: The text tasks' inputs: UTF-8 texts, ``TYPE_STRING``, dims ``[1]`` (a request of N rows is ``[N, 1]``).
INPUT_TEXT: Final = "TEXT"
INPUT_TEXT_PAIR: Final = "TEXT_PAIR"
TEXT_SPEC: Final = TensorSpec(INPUT_TEXT, "TYPE_STRING", (1,))
TEXT_PAIR_SPEC: Final = TensorSpec(INPUT_TEXT_PAIR, "TYPE_STRING", (1,), optional=True)
#: A token id inside every vocabulary, for timing passes at load (what the ids are does not change the cost).
_SYNTHETIC_TOKEN: Final = 1000


class TextTask(Task):
    """A task whose rows are texts, or text pairs where the model declares ``TEXT_PAIR``.

    Each text task has one ``TYPE_FP32`` output of one dim (``OUTPUT``), computed from one
    graph output (``GRAPH_OUTPUT``, of rank ``GRAPH_RANK``) whose last dim is its width.
    """

    #: Whether the task accepts ``TEXT_PAIR`` at all (classify: cross-encoders).
    accepts_pairs: bool = False
    OUTPUT: ClassVar[str]
    GRAPH_OUTPUT: ClassVar[str]
    GRAPH_RANK: ClassVar[int]
    #: The inputs auto-completion declares.
    COMPLETED_INPUTS: ClassVar[tuple[TensorSpec, ...]] = ()

    def __init__(self, settings: ModelSettings, config: Mapping[str, Any], version_dir: Path) -> None:
        """Load the tokenizer and check the declared inputs.

        Raises:
            ConfigError: If the tokenizer is missing or the config declares inputs the task does not take.
        """
        self.model_name = settings.model_name
        self.max_length = settings.task.max_sequence_length
        self.max_text_bytes = settings.text.max_text_bytes
        # Bytes a text may need for max_length tokens: the tail past them is cut before tokenising.
        self.cut_bytes = settings.task.max_sequence_length * settings.text.text_bytes_per_token
        self.tokenizer_path = version_file(version_dir, settings.text.tokenizer_file)
        declared = {t.name: t for t in config_tensors(config, "input", model_name=self.model_name)}
        self.pairs = INPUT_TEXT_PAIR in declared
        if self.pairs and not self.accepts_pairs:
            raise ConfigError(f"model '{self.model_name}': task '{self.name}' takes no '{INPUT_TEXT_PAIR}' input")
        expected = [TEXT_SPEC, *([TEXT_PAIR_SPEC] if self.pairs else [])]
        names = sorted(declared)
        if names != sorted(t.name for t in expected):
            allowed = f"'{INPUT_TEXT}'" + (f" and optionally '{INPUT_TEXT_PAIR}'" if self.accepts_pairs else "")
            raise ConfigError(f"model '{self.model_name}': task '{self.name}' takes input {allowed}, found {names}")
        for want in expected:
            got = declared[want.name]
            if got.data_type != want.data_type or got.dims != want.dims:
                raise ConfigError(
                    f"model '{self.model_name}': input '{want.name}' has data_type '{got.data_type}' and dims "
                    f"{list(got.dims)}, expected '{want.data_type}' and {list(want.dims)}")
        self.inputs = tuple(declared[t.name] for t in expected)
        outputs = config_tensors(config, "output", model_name=self.model_name)
        dims = outputs[0].dims if len(outputs) == 1 else ()
        if len(dims) != 1 or dims[0] <= 0:
            raise ConfigError(f"model '{self.model_name}': task '{self.name}' has one output '{self.OUTPUT}' "
                              f"(TYPE_FP32) of one positive width such as [384]; found "
                              f"{[(t.name, list(t.dims)) for t in outputs]}")
        self.outputs = (TensorSpec(self.OUTPUT, "TYPE_FP32", dims),)
        check_declared(self.model_name, "output", outputs, self.outputs)
        self.width = dims[0]
        self.graph_outputs = (self.GRAPH_OUTPUT,)
        self.tokenizer = TextTokenizer(self.tokenizer_path, self.max_length)
        self._feeds: tuple[str, ...] = TEXT_GRAPH_INPUTS

    # -- rows -----------------------------------------------------------------------------------------

    def read(self, tensors: Mapping[str, np.ndarray]) -> list[Row]:
        """The request's texts, or ``(text, pair)`` tuples when it sends ``TEXT_PAIR``."""
        texts = read_texts(tensors.get(INPUT_TEXT), INPUT_TEXT, max_bytes=self.max_text_bytes,
                           cut_bytes=self.cut_bytes)
        if not self.pairs or tensors.get(INPUT_TEXT_PAIR) is None:
            return list(texts)
        pairs = read_texts(tensors.get(INPUT_TEXT_PAIR), INPUT_TEXT_PAIR, max_bytes=self.max_text_bytes,
                           cut_bytes=self.cut_bytes)
        if len(pairs) != len(texts):
            raise InvalidInputError(f"input '{INPUT_TEXT_PAIR}' has {len(pairs)} rows but '{INPUT_TEXT}' has "
                                    f"{len(texts)}: send one pair text per text")
        return list(zip(texts, pairs, strict=True))

    def row_bytes(self, row: Row) -> bytes:
        """A text's UTF-8 bytes behind a 0 byte; a pair's behind a 1 byte and the first text's length."""
        if isinstance(row, str):
            return b"\x00" + row.encode("utf-8", errors="surrogatepass")
        first = row[0].encode("utf-8", errors="surrogatepass")
        return b"\x01" + len(first).to_bytes(8, "little") + first + row[1].encode("utf-8", errors="surrogatepass")

    @staticmethod
    def _columns(rows: Sequence[Row]) -> tuple[list[str], list[str | None] | None]:
        if all(isinstance(row, str) for row in rows):
            return list(rows), None
        texts = [row if isinstance(row, str) else row[0] for row in rows]
        pairs = [None if isinstance(row, str) else row[1] for row in rows]
        return texts, pairs

    def lengths(self, rows: Sequence[Row]) -> np.ndarray:
        """Token count of each row after truncation."""
        return self.tokenizer.lengths(*self._columns(rows))

    def prepare(self, rows: Sequence[Row]) -> Prepared:
        """Tokenise every row in one batched call (``EncodedRows``: a task of pairs encoded apart has its own)."""
        return self.tokenizer.encode(*self._columns(rows))

    def assemble(self, prepared: Any, indices: np.ndarray, padded_length: int) -> dict[str, np.ndarray]:
        """Token ids, mask and types of the rows, right-padded; only the inputs the graph takes."""
        return prepared.padded(indices, padded_length, self._feeds)

    def synthetic_feeds(self, rows: int, length: int) -> dict[str, np.ndarray]:
        """Full-length rows of one in-vocabulary token."""
        token = min(_SYNTHETIC_TOKEN, self.tokenizer.vocab_size - 1)
        every = {INPUT_IDS: np.full((rows, length), token, dtype=np.int64),
                 "attention_mask": np.ones((rows, length), dtype=np.int64),
                 "token_type_ids": np.zeros((rows, length), dtype=np.int64)}
        return {name: every[name] for name in self._feeds}

    # -- load -----------------------------------------------------------------------------------------

    def bind(self, graph: GraphIO | None) -> None:
        """Feed the graph the text inputs it takes; check its output's width against the declared one.

        Raises:
            ConfigError: If the graph takes an input a text task cannot fill, lacks ``input_ids``, or
                its output does not fit.
        """
        if graph is not None:
            self._feeds = text_feeds(graph, model_name=self.model_name, task=self.name)
        width = graph_width(graph, self.GRAPH_OUTPUT, model_name=self.model_name, rank=self.GRAPH_RANK)
        if width is not None and width != self.width:
            raise ConfigError(f"model '{self.model_name}': output {self.OUTPUT} has dims [{self.width}] but the "
                              f"graph produces width {width}")

    def graph_output(self, batch: Pass, results: Mapping[str, np.ndarray]) -> np.ndarray:
        """The pass's ``GRAPH_OUTPUT``, its shape checked.

        Raises:
            RuntimeFailure: If it came back in another shape.
        """
        value = results[self.GRAPH_OUTPUT]
        rows = len(batch.indices)
        expected = (rows, batch.padded_length, self.width) if self.GRAPH_RANK == 3 else (rows, self.width)
        if value.shape != expected:
            raise RuntimeFailure(f"'{self.GRAPH_OUTPUT}' came back with shape {list(value.shape)}, expected "
                                 f"{list(expected)}")
        return value

    def fingerprint(self) -> dict[str, Any]:
        """The tokenizer's content and truncation, and the task's own output settings."""
        return {"task": self.name, "tokenizer_sha256": file_digest(self.tokenizer_path),
                "max_sequence_length": self.max_length, **self._output_settings()}

    @abc.abstractmethod
    def _output_settings(self) -> dict[str, Any]:
        """The task's settings that change its outputs."""

    @classmethod
    def complete(cls, config: Mapping[str, Any], graph: GraphIO | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """``COMPLETED_INPUTS`` when no input is declared; ``OUTPUT`` of the graph output's width when no output is.

        Raises:
            ConfigError: If the graph takes inputs a text task cannot fill.
        """
        inputs = [] if config.get("input") else list(cls.COMPLETED_INPUTS)
        outputs: list[TensorSpec] = []
        if graph is not None:
            text_feeds(graph, model_name=str(config.get("name", "model")), task=cls.name)
            found = graph.output(cls.GRAPH_OUTPUT)
            if not config.get("output") and found is not None and found.shape and found.shape[-1] is not None:
                outputs.append(TensorSpec(cls.OUTPUT, "TYPE_FP32", (found.shape[-1],)))
        return inputs, outputs


def text_feeds(graph: GraphIO, *, model_name: str, task: str) -> tuple[str, ...]:
    """The inputs a text task feeds ``graph``: those it takes of ``TEXT_GRAPH_INPUTS``.

    Raises:
        ConfigError: If the graph takes an input a text task cannot fill, or lacks ``input_ids``.
    """
    names = [t.name for t in graph.inputs]
    if INPUT_IDS not in names or any(n not in TEXT_GRAPH_INPUTS for n in names):
        raise ConfigError(f"model '{model_name}': the graph takes inputs {names}; task '{task}' fills "
                          f"{list(TEXT_GRAPH_INPUTS)} (input_ids required). Serve other graphs with task 'tensor'")
    return tuple(n for n in TEXT_GRAPH_INPUTS if n in names)


def graph_width(graph: GraphIO | None, output: str, *, model_name: str, rank: int) -> int | None:
    """The static last dim of graph output ``output`` of rank ``rank``, or None where the runtime cannot say (BLS).

    Raises:
        ConfigError: If the graph lacks the output, has another rank, or its last dim is not static.
    """
    if graph is None:
        return None
    tensor = graph.output(output)
    if tensor is None:
        raise ConfigError(f"model '{model_name}': the graph has no output '{output}' "
                          f"(outputs: {[t.name for t in graph.outputs]})")
    if len(tensor.shape) != rank or tensor.shape[-1] is None:
        raise ConfigError(f"model '{model_name}': graph output '{output}' has shape {list(tensor.shape)}, "
                          f"expected {rank} dims with a static last one")
    return tensor.shape[-1]
