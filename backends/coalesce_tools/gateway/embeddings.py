"""``POST /v1/embeddings``: OpenAI's embeddings over a model of task ``embedding``."""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

import numpy as np

from coalesce_tools.gateway.catalog import EMBEDDINGS, ModelEntry
from coalesce_tools.gateway.errors import invalid
from coalesce_tools.gateway.fields import integer, text_list

if TYPE_CHECKING:
    from coalesce_tools.gateway.app import Gateway


def widths(model: ModelEntry) -> tuple[int, ...]:
    """The widths ``dimensions`` may ask of ``model``: its declared Matryoshka widths and its full one."""
    return tuple(sorted({*model.settings.embedding.matryoshka_widths, model.width}, reverse=True))


def cut(vectors: np.ndarray, dimensions: int, *, normalize: bool) -> np.ndarray:
    """The first ``dimensions`` of each vector, re-normalised where the model normalises (a Matryoshka cut)."""
    head = np.ascontiguousarray(vectors[:, :dimensions], dtype=np.float32)
    if normalize:
        norms = np.linalg.norm(head, axis=1, keepdims=True)
        head /= np.where(norms > 0, norms, 1.0)
    return head


async def embed(gateway: Gateway, model: ModelEntry, texts: list[str], *, request_id: str,
                parameters: dict[str, Any]) -> np.ndarray:
    """Vectors of ``texts``: one Triton request of up to ``max_batch_size`` rows, several at once past it."""
    limit = model.max_rows
    chunks = [texts[i:i + limit] for i in range(0, len(texts), limit)]
    results = await asyncio.gather(*(
        gateway.triton.infer(model.name, {"TEXT": np.array(chunk, dtype=object).reshape(-1, 1)}, model.output,
                             request_id=request_id, parameters=parameters)
        for chunk in chunks))
    return results[0] if len(results) == 1 else np.concatenate(results)


async def handle(gateway: Gateway, body: dict[str, Any], request_id: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The embeddings response.

    Raises:
        ApiError: On a field that is wrong (400), an unknown model (404), or Triton's error.
    """
    model = await gateway.catalog.get(body.get("model"), EMBEDDINGS)
    texts = text_list(body.get("input"), "input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid(f"'encoding_format' is {encoding!r}; it must be 'float' or 'base64'", "encoding_format")
    dimensions = integer(body, "dimensions", low=1)
    if dimensions is not None and dimensions not in widths(model):
        declared = model.settings.embedding.matryoshka_widths
        why = (f"its config declares Matryoshka widths {list(declared)}" if declared else
               "it declares no Matryoshka widths (parameter matryoshka_dimensions), so it is not cut")
        raise invalid(f"model '{model.name}' gives {model.width} dimensions and {dimensions} cannot be asked: "
                      f"{why}", "dimensions")
    vectors = await embed(gateway, model, texts, request_id=request_id, parameters=parameters)
    if dimensions is not None and dimensions != model.width:
        vectors = cut(vectors, dimensions, normalize=model.settings.embedding.normalize)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    tokens = int(model.text_tokenizer.lengths(texts).sum())
    gateway.metrics.rows.labels(model.name).inc(len(texts))
    gateway.metrics.tokens.labels(model.name, "prompt").inc(tokens)
    if encoding == "base64":
        data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(v.tobytes()).decode("ascii")}
                for i, v in enumerate(vectors)]
    else:
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model.name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
