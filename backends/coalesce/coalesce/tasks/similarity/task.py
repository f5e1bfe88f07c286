"""The ``similarity`` task: each (text, pair) row to the cosine of the two texts' embeddings.

Contract: inputs ``TEXT`` and ``TEXT_PAIR`` (``TYPE_STRING``, dims ``[1]`` each, both
required: a call is N rows of (query, document)); output ``SCORES`` (``TYPE_FP32``, dims
``[1]``): the cosine, in [-1, 1], of the two texts' pooled embeddings. This is a
bi-encoder's score (each text encoded alone, as vLLM's ``/score`` does for embedding
models and sentence-transformers' ``util.cos_sim`` on ``encode`` vectors), not a
cross-encoder's (both texts in one sequence: task ``classify`` with ``TEXT_PAIR``).

The graph is an embedding model's (``last_hidden_state``), pooled as the ``embedding``
task pools it. A pass over k rows feeds it 2k sequences, the k first texts and then the
k pair texts, all padded to the pass's length; a row's length (what the planner sorts
and cuts by) is the longer of its two texts, and the cost model is calibrated on passes
of 2k sequences, so it predicts what a pass of k rows costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np

from coalesce.core.errors import ConfigError, InvalidInputError, RuntimeFailure
from coalesce.core.task import Pass, Row, Task
from coalesce.core.tensors import GraphIO, TensorSpec
from coalesce.settings import ModelSettings
from coalesce.tasks.classify.task import OUTPUT_SCORES
from coalesce.tasks.embedding.pooling import pool
from coalesce.tasks.embedding.task import GRAPH_HIDDEN, OUTPUT_EMBEDDING, EmbeddingTask
from coalesce.tasks.text.task import INPUT_TEXT, INPUT_TEXT_PAIR, TEXT_SPEC, graph_width, text_feeds
from coalesce.tasks.text.tokenizer import EncodedRows

#: Both inputs are required: every row is a pair.
REQUIRED_PAIR_SPEC: Final = TensorSpec(INPUT_TEXT_PAIR, "TYPE_STRING", (1,))
SCORES_SPEC: Final = TensorSpec(OUTPUT_SCORES, "TYPE_FP32", (1,))


@dataclasses.dataclass(frozen=True)
class EncodedPairs:
    """Both texts of every row, each tokenised alone: row i's text is sequence i, its pair sequence n + i.

    Attributes:
        sequences: The 2n token sequences, unpadded.
        lengths: Each row's length: the longer of its two sequences.
    """

    sequences: EncodedRows
    lengths: np.ndarray

    @classmethod
    def of(cls, sequences: EncodedRows) -> EncodedPairs:
        """Rows from 2n sequences (n first texts, then their n pairs)."""
        each = sequences.lengths
        half = len(each) // 2
        return cls(sequences, np.maximum(each[:half], each[half:]))

    def sequence_indices(self, rows: np.ndarray) -> np.ndarray:
        """The sequences of ``rows``: their first texts, then their pairs, in row order."""
        rows = np.asarray(rows, dtype=np.int64)
        return np.concatenate([rows, rows + len(self.lengths)])


class SimilarityTask(EmbeddingTask):
    """(text, pair) rows to the cosine of the two texts' pooled embeddings: a bi-encoder scorer."""

    name: ClassVar[str] = "similarity"
    accepts_pairs = True
    graph_rows_per_row: ClassVar[int] = 2
    OUTPUT: ClassVar[str] = OUTPUT_SCORES
    COMPLETED_INPUTS: ClassVar[tuple[TensorSpec, ...]] = (TEXT_SPEC, REQUIRED_PAIR_SPEC)

    def __init__(self, settings: ModelSettings, config: Mapping[str, Any], version_dir: Path) -> None:
        """Check the declared contract (``TEXT`` and a required ``TEXT_PAIR``; ``SCORES`` of dims ``[1]``).

        Raises:
            ConfigError: If the config declares another contract, or the tokenizer is missing.
        """
        super().__init__(settings, config, version_dir)
        where = f"model '{self.model_name}': task '{self.name}'"
        if not self.pairs or self.inputs[1].optional:
            raise ConfigError(f"{where} scores (text, pair) rows: declare inputs '{INPUT_TEXT}' and "
                              f"'{INPUT_TEXT_PAIR}' (TYPE_STRING, dims [1]), neither optional")
        if self.width != 1:
            raise ConfigError(f"{where} gives one score per row: output '{OUTPUT_SCORES}' has dims [1], found "
                              f"[{self.width}]")
        self._settings = settings
        self._version_dir = version_dir
        self._graph: GraphIO | None = None
        #: The graph's hidden width, once bound to a graph that says it (None under BLS).
        self.hidden_width: int | None = None

    # -- rows -----------------------------------------------------------------------------------------

    def read(self, tensors: Mapping[str, np.ndarray]) -> list[Row]:
        """The request's ``(text, pair)`` rows.

        Raises:
            InvalidInputError: If ``TEXT_PAIR`` is missing, or a text is not valid or too long.
        """
        if tensors.get(INPUT_TEXT_PAIR) is None:
            raise InvalidInputError(f"request has no input '{INPUT_TEXT_PAIR}': task '{self.name}' scores "
                                    f"(text, pair) rows, one '{INPUT_TEXT_PAIR}' text per '{INPUT_TEXT}' text")
        return super().read(tensors)

    @staticmethod
    def _sequences(rows: Sequence[Row]) -> list[str]:
        return [row[0] for row in rows] + [row[1] for row in rows]

    def lengths(self, rows: Sequence[Row]) -> np.ndarray:
        """Each row's length: the token count of the longer of its two texts (each truncated alone)."""
        each = self.tokenizer.lengths(self._sequences(rows))
        return np.maximum(each[:len(rows)], each[len(rows):])

    def prepare(self, rows: Sequence[Row]) -> EncodedPairs:
        """Tokenise every row's two texts apart, in one batched call."""
        return EncodedPairs.of(self.tokenizer.encode(self._sequences(rows)))

    def assemble(self, prepared: Any, indices: np.ndarray, padded_length: int) -> dict[str, np.ndarray]:
        """The rows' first texts, then their pairs: ``2 * len(indices)`` sequences, right-padded."""
        return prepared.sequences.padded(prepared.sequence_indices(indices), padded_length, self._feeds)

    def split(self, batch: Pass, results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Pool each sequence over its own tokens; each row's score is the cosine of its two vectors.

        Raises:
            RuntimeFailure: If the token states came back in another shape.
        """
        hidden = results[GRAPH_HIDDEN]
        rows = len(batch.indices)
        if hidden.ndim != 3 or hidden.shape[:2] != (2 * rows, batch.padded_length) or (
                self.hidden_width is not None and hidden.shape[2] != self.hidden_width):
            raise RuntimeFailure(f"'{GRAPH_HIDDEN}' came back with shape {list(hidden.shape)}, expected "
                                 f"[{2 * rows}, {batch.padded_length}, {self.hidden_width or 'width'}] "
                                 f"(2 sequences a row)")
        prepared: EncodedPairs = batch.prepared  # type: ignore[assignment]
        lengths = prepared.sequences.lengths[prepared.sequence_indices(batch.indices)]
        mask = np.arange(batch.padded_length)[None, :] < lengths[:, None]
        vectors = pool(hidden, mask, mode=self.pooling, normalize=True)
        cosine = np.einsum("ij,ij->i", vectors[:rows], vectors[rows:])
        # Rounding can take a cosine of unit vectors a hair past +-1; the contract is [-1, 1].
        return {OUTPUT_SCORES: np.clip(cosine, -1.0, 1.0).astype(np.float32).reshape(rows, 1)}

    def synthetic_feeds(self, rows: int, length: int) -> dict[str, np.ndarray]:
        """A pass of ``rows`` rows: ``2 * rows`` full-length sequences."""
        return super().synthetic_feeds(2 * rows, length)

    def unit_norm_outputs(self) -> frozenset[str]:
        """None: a score is not a vector."""
        return frozenset()

    # -- load -----------------------------------------------------------------------------------------

    def bind(self, graph: GraphIO | None) -> None:
        """Feed the graph the text inputs it takes; check that it gives token states and learn their width.

        Raises:
            ConfigError: If the graph takes an input a text task cannot fill, lacks ``input_ids``, or has no
                ``last_hidden_state`` of rank 3.
        """
        if graph is not None:
            self._feeds = text_feeds(graph, model_name=self.model_name, task=self.name)
        self.hidden_width = graph_width(graph, GRAPH_HIDDEN, model_name=self.model_name, rank=3)
        self._graph = graph

    def guarded_task(self) -> Task:
        """An ``embedding`` task on the same tokenizer, pooling and graph: the guard compares each text's vector.

        Raises:
            ConfigError: If the task is not bound to a graph that gives its hidden width.
        """
        if self.hidden_width is None:
            raise ConfigError(f"model '{self.model_name}': the INT8 accuracy guard compares embeddings and needs "
                              f"the graph's '{GRAPH_HIDDEN}' width, which runtime gives none")
        config = {"name": self.model_name, "input": [TEXT_SPEC.as_config()],
                  "output": [TensorSpec(OUTPUT_EMBEDDING, "TYPE_FP32", (self.hidden_width,)).as_config()]}
        embedding = EmbeddingTask(self._settings, config, self._version_dir)
        embedding.bind(self._graph)
        return embedding

    def _output_settings(self) -> dict[str, Any]:
        return {"pooling": self.pooling, "score": "cosine"}

    @classmethod
    def complete(cls, config: Mapping[str, Any], graph: GraphIO | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """``TEXT`` and a required ``TEXT_PAIR`` when no input is declared; ``SCORES`` of dims [1] when no output is.

        Raises:
            ConfigError: If the graph takes inputs a text task cannot fill.
        """
        if graph is not None:
            text_feeds(graph, model_name=str(config.get("name", "model")), task=cls.name)
        return ([] if config.get("input") else list(cls.COMPLETED_INPUTS),
                [] if config.get("output") else [SCORES_SPEC])
