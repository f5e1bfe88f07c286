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

from coalesce.core.errors import ConfigError, RuntimeFailure
from coalesce.core.task import Pass
from coalesce.core.tensors import GraphIO, TensorSpec, check_declared, config_tensors
from coalesce.settings import ModelSettings
from coalesce.tasks.text.task import TEXT_PAIR_SPEC, TEXT_SPEC, TextTask, graph_width, text_feeds

OUTPUT_SCORES: Final = "SCORES"
#: The graph output: one logit per label, ``[rows, num_labels]``.
GRAPH_LOGITS: Final = "logits"


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    """``logits`` as they are (``none``), through a sigmoid per label, or a softmax over the labels; float32."""
    values = logits.astype(np.float32, copy=False)
    if activation == "sigmoid":
        return (1.0 / (1.0 + np.exp(-values))).astype(np.float32)
    if activation == "softmax":
        shifted = np.exp(values - values.max(axis=-1, keepdims=True))
        return (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)
    return np.ascontiguousarray(values)


class ClassifyTask(TextTask):
    """Texts or text pairs to label scores (classifiers and cross-encoder rerankers)."""

    name: ClassVar[str] = "classify"
    torch_head: ClassVar[str | None] = "sequence-classification"
    accepts_pairs = True

    def __init__(self, settings: ModelSettings, config: Mapping[str, Any], version_dir: Path) -> None:
        """Check the declared output and load the tokenizer.

        Raises:
            ConfigError: If the config does not declare the classify contract.
        """
        super().__init__(settings, config, version_dir)
        outputs = config_tensors(config, "output", model_name=self.model_name)
        dims = outputs[0].dims if len(outputs) == 1 else ()
        if len(dims) != 1 or dims[0] <= 0:
            raise ConfigError(f"model '{self.model_name}': task 'classify' has one output '{OUTPUT_SCORES}' "
                              f"(TYPE_FP32) with dims [num_labels]; found {[(t.name, list(t.dims)) for t in outputs]}")
        check_declared(self.model_name, "output", outputs, [TensorSpec(OUTPUT_SCORES, "TYPE_FP32", dims)])
        self.num_labels = dims[0]
        self.outputs = (TensorSpec(OUTPUT_SCORES, "TYPE_FP32", dims),)
        self.graph_outputs = (GRAPH_LOGITS,)
        self.activation = settings.classify.activation

    def _bind_outputs(self, graph: GraphIO | None) -> None:
        labels = graph_width(graph, GRAPH_LOGITS, model_name=self.model_name, rank=2)
        if labels is not None and labels != self.num_labels:
            raise ConfigError(f"model '{self.model_name}': output {OUTPUT_SCORES} has dims [{self.num_labels}] but "
                              f"the graph gives {labels} logits per row")

    def split(self, batch: Pass, results: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each row's logits, through the activation."""
        logits = results[GRAPH_LOGITS]
        if logits.shape != (len(batch.indices), self.num_labels):
            raise RuntimeFailure(f"'{GRAPH_LOGITS}' came back with shape {list(logits.shape)}, expected "
                                 f"[{len(batch.indices)}, {self.num_labels}]")
        return {OUTPUT_SCORES: activate(logits, self.activation)}

    def _output_settings(self) -> dict[str, Any]:
        return {"activation": self.activation}

    @classmethod
    def complete(cls, config: Mapping[str, Any], graph: GraphIO | None) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """``TEXT`` and an optional ``TEXT_PAIR`` when no input is declared; ``SCORES`` per the graph's labels."""
        inputs = [] if config.get("input") else [TEXT_SPEC, TEXT_PAIR_SPEC]
        outputs: list[TensorSpec] = []
        if graph is not None:
            text_feeds(graph, model_name=str(config.get("name", "model")), task=cls.name)
        if not config.get("output") and graph is not None:
            logits = graph.output(GRAPH_LOGITS)
            if logits is not None and logits.shape and logits.shape[-1] is not None:
                outputs.append(TensorSpec(OUTPUT_SCORES, "TYPE_FP32", (logits.shape[-1],)))
        return inputs, outputs
