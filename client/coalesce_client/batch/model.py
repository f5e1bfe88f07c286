"""What a job sends a served model and reads back, from the model's config on every server."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np

from coalesce_client.client import EmbeddingClient
from coalesce_client.errors import (
    BatchJobError,
    ClientError,
    RequestTimeoutError,
    ServerUnavailableError,
)

#: The backend's default ``max_request_bytes``, for a model whose config does not set it.
DEFAULT_MAX_REQUEST_BYTES: Final = 4 * 1024 * 1024
#: Triton's numeric output types, as numpy types.
TRITON_DTYPES: Final = {"TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
                        "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
                        "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
                        "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}


@dataclasses.dataclass(frozen=True)
class ModelIO:
    """What a bulk job sends a model and reads back, from its config.

    Attributes:
        model: Model name.
        text_input: The input the texts go to (``TEXT``).
        pair_input: The input of the second texts (``TEXT_PAIR``), for a pair model.
        output: The output written (``EMBEDDING``, ``SCORES``).
        output_dims: Its dims per row, e.g. ``(384,)`` or ``(1,)``.
        output_type: Its Triton type, e.g. ``TYPE_FP32``.
        max_rows: The model's ``max_batch_size``: most rows per request.
        max_request_bytes: The model's ``max_request_bytes`` (the backend's default where unset).
        max_sequence_length: The model's ``max_sequence_length`` (where its config sets it): the
            tokens a row is truncated to, so rows longer than it cost the same.
        max_batch_tokens: The model's ``max_batch_tokens`` (where its config sets it): the most
            padded tokens of one forward pass.
        instances: The model's instances (``instance_group`` counts): requests it computes at once.
    """

    model: str
    text_input: str
    pair_input: str | None
    output: str
    output_dims: tuple[int, ...]
    output_type: str
    max_rows: int
    max_request_bytes: int
    max_sequence_length: int | None = None
    max_batch_tokens: int | None = None
    instances: int = 1

    @property
    def width(self) -> int:
        """Values per row."""
        return math.prod(self.output_dims)

    @property
    def scalar(self) -> bool:
        """Whether each row's output is a single value (a one-label classifier's score)."""
        return self.width == 1

    @property
    def column(self) -> str:
        """The output's column in the Parquet file: its name in lower case."""
        return self.output.lower()

    @property
    def dtype(self) -> np.dtype:
        """The output's numpy type."""
        return np.dtype(TRITON_DTYPES[self.output_type])


def model_io(config: Mapping[str, Any], *, output: str | None = None, pair: bool = False) -> ModelIO:
    """What to send ``config``'s model and what to read back (Triton's JSON config, as the server completed it).

    The texts go to ``TEXT`` (else the first string input), second texts to ``TEXT_PAIR``
    (else the second string input). The output is ``output``, or the model's only one.

    Raises:
        BatchJobError: The model does not take texts, takes a pair when none was given (or
            the reverse), has no such output, or an output of variable or non-numeric shape.
    """
    name = str(config.get("name", "?"))
    max_rows = int(config.get("max_batch_size", 0) or 0)
    if max_rows < 1:
        raise BatchJobError(f"model {name!r} has max_batch_size 0: a bulk job sends rows in batches")
    inputs = list(config.get("input", []))
    texts = [i["name"] for i in inputs if i.get("data_type") == "TYPE_STRING"]
    others = [f"{i['name']} ({i.get('data_type')})" for i in inputs
              if i.get("data_type") != "TYPE_STRING" and not i.get("optional", False)]
    if others or not texts:
        raise BatchJobError(f"model {name!r} takes {', '.join(others) or 'no text input'}: a bulk job sends texts "
                            "(call tensor models with tritonclient)")
    text_input = "TEXT" if "TEXT" in texts else texts[0]
    rest = [t for t in texts if t != text_input]
    pair_input = ("TEXT_PAIR" if "TEXT_PAIR" in rest else rest[0]) if rest else None
    if len(rest) > 1:
        raise BatchJobError(f"model {name!r} takes {len(texts)} texts per row; a bulk job sends one or two")
    if pair_input and not pair:
        raise BatchJobError(f"model {name!r} takes a text pair ({text_input}, {pair_input}): give the second "
                            "texts' column (--pair-column)")
    if pair and not pair_input:
        raise BatchJobError(f"model {name!r} takes one text ({text_input}): leave out the pair column")
    outputs = {o["name"]: o for o in config.get("output", [])}
    if output is None:
        if len(outputs) != 1:
            raise BatchJobError(f"model {name!r} has outputs {', '.join(outputs) or '(none)'}: name the one to "
                                "write (--output-name)")
        output = next(iter(outputs))
    if output not in outputs:
        raise BatchJobError(f"model {name!r} has no output {output!r} (it has {', '.join(outputs)})")
    spec = outputs[output]
    dims = tuple(int(d) for d in spec.get("dims", []))
    if not dims or any(d < 1 for d in dims):
        raise BatchJobError(f"output {output!r} of model {name!r} has dims {list(dims)}: a bulk job writes "
                            "fixed-size rows")
    kind = str(spec.get("data_type"))
    if kind not in TRITON_DTYPES:
        raise BatchJobError(f"output {output!r} of model {name!r} is {kind}: a bulk job writes numbers")
    parameters = config.get("parameters", {})

    def parameter(key: str) -> int | None:
        value = parameters.get(key, {}).get("string_value")
        return int(value) if value else None

    return ModelIO(model=name, text_input=text_input, pair_input=pair_input, output=output, output_dims=dims,
                   output_type=kind, max_rows=max_rows,
                   max_request_bytes=parameter("max_request_bytes") or DEFAULT_MAX_REQUEST_BYTES,
                   max_sequence_length=parameter("max_sequence_length"),
                   max_batch_tokens=parameter("max_batch_tokens"),
                   instances=max(1, sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1))



def discover(clients: Sequence[EmbeddingClient], log: Callable[[str], None], *, output: str | None = None,
             pair: bool = False) -> tuple[ModelIO, list[EmbeddingClient]]:
    """The model's I/O (``model_io``), read from every server's config; the servers that answered, in order.

    Raises:
        BatchJobError: No server answered, or two servers serve the model differently.
        ClientError: The model is unknown or access is denied.
    """
    found: ModelIO | None = None
    answered: list[EmbeddingClient] = []
    last: ClientError | None = None
    for client in clients:
        try:
            config = client.model_config()
        except (ServerUnavailableError, RequestTimeoutError) as exc:
            log(f"coalesce-client: {client.url} does not answer ({type(exc).__name__}); going on without it")
            last = exc
            continue
        io = model_io(config, output=output, pair=pair)
        if found is not None and io != found:
            raise BatchJobError(f"{client.url} serves {client.model!r} differently from {answered[0].url}: "
                                f"{io} against {found}")
        found = io
        answered.append(client)
    if found is None:
        raise BatchJobError(f"no server answered: {last}")
    return found, answered


