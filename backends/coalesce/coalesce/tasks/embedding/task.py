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

from coalesce.core.task import Pass
from coalesce.core.tensors import TensorSpec
from coalesce.settings import ModelSettings
from coalesce.tasks.embedding.pooling import pool
from coalesce.tasks.text.task import TEXT_SPEC, TextTask

OUTPUT_EMBEDDING: Final = "EMBEDDING"
#: The graph output the task pools: token states ``[rows, tokens, width]``.
GRAPH_HIDDEN: Final = "last_hidden_state"


class EmbeddingTask(TextTask):
    """Texts to pooled, optionally L2-normalised vectors."""

    name: ClassVar[str] = "embedding"
    torch_head: ClassVar[str | None] = "base"
    OUTPUT: ClassVar[str] = OUTPUT_EMBEDDING
    GRAPH_OUTPUT: ClassVar[str] = GRAPH_HIDDEN
    GRAPH_RANK: ClassVar[int] = 3
    COMPLETED_INPUTS: ClassVar[tuple[TensorSpec, ...]] = (TEXT_SPEC,)

    def __init__(self, settings: ModelSettings, config: Mapping[str, Any], version_dir: Path) -> None:
        """Check the declared contract, load the tokenizer, take the pooling settings.

        Raises:
            ConfigError: If the config does not declare the embedding contract.
        """
        super().__init__(settings, config, version_dir)
        self.pooling = settings.embedding.pooling
        self.normalize = settings.embedding.normalize

    def split(self, batch: Pass, results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Pool each row's token states over its own tokens."""
        hidden = self.graph_output(batch, results)
        mask = np.arange(batch.padded_length)[None, :] < batch.lengths[:, None]
        return {OUTPUT_EMBEDDING: pool(hidden, mask, mode=self.pooling, normalize=self.normalize)}

    def unit_norm_outputs(self) -> frozenset[str]:
        """``EMBEDDING`` where the task normalises it."""
        return frozenset({OUTPUT_EMBEDDING}) if self.normalize else frozenset()

    def _output_settings(self) -> dict[str, Any]:
        return {"pooling": self.pooling, "normalize": self.normalize}
