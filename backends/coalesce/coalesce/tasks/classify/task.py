"""The ``classify`` task: texts, or text pairs, to one score per label.

Contract: input ``TEXT`` (``TYPE_STRING``, dims ``[1]``) and, for pair models such as
cross-encoder rerankers, ``TEXT_PAIR`` (same; a rerank call is N rows of (query,
document)); output ``SCORES`` (``TYPE_FP32``, dims ``[num_labels]``): the graph's
``logits`` as they are or after ``activation`` (``sigmoid`` per label, ``softmax``
over the labels). Any Hugging Face sequence-classification model exported by
``coalesce export --task classify`` fits. A pair's length is its tokens, both texts
together, so pairs are sorted and cut into passes like single texts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Final

import numpy as np

from coalesce.core.task import Pass
from coalesce.core.tensors import TensorSpec
from coalesce.settings import ModelSettings
from coalesce.tasks.text.task import TEXT_PAIR_SPEC, TEXT_SPEC, TextTask

OUTPUT_SCORES: Final = "SCORES"
#: The graph output: one logit per label, ``[rows, num_labels]``.
GRAPH_LOGITS: Final = "logits"


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """``logits`` as they are (``none``), through a sigmoid per label, or a softmax over the labels; float32."""
    values = logits.astype(np.float32, copy=False)
    if activation == "sigmoid":
        # exp of -|x| only: 1 / (1 + exp(-x)) overflows below about -88 in float32.
        small = np.exp(-np.abs(values))
        return np.where(values >= 0, 1.0 / (1.0 + small), small / (1.0 + small)).astype(np.float32)
    if activation == "softmax":
        shifted = np.exp(values - values.max(axis=-1, keepdims=True))
        return (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)
    return np.ascontiguousarray(values)


class ClassifyTask(TextTask):
    """Texts or text pairs to label scores (classifiers and cross-encoder rerankers)."""

    name: ClassVar[str] = "classify"
    torch_head: ClassVar[str | None] = "sequence-classification"
    accepts_pairs = True
    OUTPUT: ClassVar[str] = OUTPUT_SCORES
    GRAPH_OUTPUT: ClassVar[str] = GRAPH_LOGITS
    GRAPH_RANK: ClassVar[int] = 2
    COMPLETED_INPUTS: ClassVar[tuple[TensorSpec, ...]] = (TEXT_SPEC, TEXT_PAIR_SPEC)

    def __init__(self, settings: ModelSettings, config: Mapping[str, Any], version_dir: Path) -> None:
        """Check the declared contract, load the tokenizer, take the activation.

        Raises:
            ConfigError: If the config does not declare the classify contract.
        """
        super().__init__(settings, config, version_dir)
        self.activation = settings.classify.activation

    def split(self, batch: Pass, results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each row's logits, through the activation."""
        return {OUTPUT_SCORES: activate(self.graph_output(batch, results), self.activation)}

    def _output_settings(self) -> dict[str, Any]:
        return {"activation": self.activation}
