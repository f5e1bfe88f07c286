"""The I/O contract of the embedding task, declared once.

Tensor names and shapes here are the single source of truth: the adapter reads
requests by these names, settings validation checks ``config.pbtxt`` against
them, and the client library sends them.
"""

from __future__ import annotations

from typing import Final

#: Input tensor: UTF-8 texts, ``TYPE_STRING``, dims ``[1]`` (a request of N texts is ``[N, 1]``).
INPUT_TEXT: Final = "TEXT"
INPUT_TEXT_DATATYPE: Final = "TYPE_STRING"
INPUT_TEXT_DIMS: Final = (1,)

#: Output tensor: one L2-normalised FP32 embedding per text, dims ``[hidden_size]``.
OUTPUT_EMBEDDING: Final = "EMBEDDING"
OUTPUT_EMBEDDING_DATATYPE: Final = "TYPE_FP32"

#: Names of the transformer graph's inputs and output, as exported by ``coalesce.export``.
GRAPH_INPUT_IDS: Final = "input_ids"
GRAPH_ATTENTION_MASK: Final = "attention_mask"
GRAPH_TOKEN_TYPE_IDS: Final = "token_type_ids"
GRAPH_OUTPUT_HIDDEN: Final = "last_hidden_state"
