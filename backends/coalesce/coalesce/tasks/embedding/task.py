"""The ``embedding`` task: each text to one vector, pooled from the graph's token states.

Contract: input ``TEXT`` (``TYPE_STRING``, dims ``[1]``), output ``EMBEDDING``
(``TYPE_FP32``, dims ``[width]``, the graph's hidden width). The graph (any Hugging Face
encoder exported by ``coalesce export``) returns ``last_hidden_state``; the task pools it
(mean over the attention mask, or the first token) and L2-normalises it, as
sentence-transformers ``encode(..., normalize_embeddings=True)`` does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np

from coalesce.core.errors import ConfigError, RuntimeFailure
from coalesce.core.task import Pass
from coalesce.core.tensors import GraphIO, TensorSpec, check_declared, config_tensors
from coalesce.settings import ModelSettings
from coalesce.tasks.embedding.pooling import pool
from coalesce.tasks.text.task import TEXT_SPEC, TextTask, graph_width, text_feeds

OUTPUT_EMBEDDING: Final = "EMBEDDING"
#: The graph output the task pools: token states ``[rows, tokens, width]``.
GRAPH_HIDDEN: Final = "last_hidden_state"


class EmbeddingTask(TextTask):
    """Texts to pooled, optionally L2-normalised vectors."""

    name: ClassVar[str] = "embedding"
    torch_head: ClassVar[str | None] = "base"

    def __init__(self, settings: ModelSettings, config: Mapping[str, Any], version_dir: Path) -> None:
        """Check the declared output and load the tokenizer.

        Raises:
            ConfigError: If the config does not declare the embedding contract.
        """
        super().__init__(settings, config, version_dir)
        outputs = config_tensors(config, "output", model_name=self.model_name)
        dims = outputs[0].dims if len(outputs) == 1 else ()
        if len(dims) != 1 or dims[0] <= 0:
            raise ConfigError(f"model '{self.model_name}': task 'embedding' has one output '{OUTPUT_EMBEDDING}' "
                              f"(TYPE_FP32) with one positive width such as [384]; found "
                              f"{[(t.name, list(t.dims)) for t in outputs]}")
        check_declared(self.model_name, "output", outputs, [TensorSpec(OUTPUT_EMBEDDING, "TYPE_FP32", dims)])
        self.width = dims[0]
        self.outputs = (TensorSpec(OUTPUT_EMBEDDING, "TYPE_FP32", dims),)
        self.graph_outputs = (GRAPH_HIDDEN,)
        self.pooling = settings.embedding.pooling
        self.normalize = settings.embedding.normalize

    def _bind_outputs(self, graph: GraphIO | None) -> None:
        width = graph_width(graph, GRAPH_HIDDEN, model_name=self.model_name, rank=3)
        if width is not None and width != self.width:
            raise ConfigError(f"model '{self.model_name}': output {OUTPUT_EMBEDDING} has dims [{self.width}] but "
                              f"the graph produces width {width}")

    def split(self, batch: Pass, results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Pool each row's token states over its own tokens."""
        hidden = results[GRAPH_HIDDEN]
        if hidden.ndim != 3 or hidden.shape[:2] != (len(batch.indices), batch.padded_length) \
                or hidden.shape[2] != self.width:
            raise RuntimeFailure(f"'{GRAPH_HIDDEN}' came back with shape {list(hidden.shape)}, expected "
                                 f"[{len(batch.indices)}, {batch.padded_length}, {self.width}]")
        mask = np.arange(batch.padded_length)[None, :] < batch.lengths[:, None]
        return {OUTPUT_EMBEDDING: pool(hidden, mask, mode=self.pooling, normalize=self.normalize)}

    def _output_settings(self) -> dict[str, Any]:
        return {"pooling": self.pooling, "normalize": self.normalize}

    @classmethod
    def complete(cls, config: Mapping[str, Any], graph: GraphIO | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """``TEXT`` when no input is declared; ``EMBEDDING`` of the graph's width when no output is."""
        inputs = [] if config.get("input") else [TEXT_SPEC]
        outputs: list[TensorSpec] = []
        if graph is not None:
            text_feeds(graph, model_name=str(config.get("name", "model")), task=cls.name)
        if not config.get("output") and graph is not None:
            hidden = graph.output(GRAPH_HIDDEN)
            if hidden is not None and hidden.shape and hidden.shape[-1] is not None:
                outputs.append(TensorSpec(OUTPUT_EMBEDDING, "TYPE_FP32", (hidden.shape[-1],)))
        return inputs, outputs
