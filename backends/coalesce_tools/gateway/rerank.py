"""``POST /v1/rerank`` and ``/v2/rerank`` (Cohere/Jina shape) and ``POST /v1/score`` (vLLM's) over a pair scorer.

A pair scorer is any model taking ``TEXT`` and ``TEXT_PAIR`` and giving one score a row: a
cross-encoder under task ``classify``, or a bi-encoder scorer. Every pair of a call goes to
Triton as rows of one request (several past ``max_batch_size``), so coalescing and the row
cache apply.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from coalesce_tools.gateway.catalog import RERANK, ModelEntry
from coalesce_tools.gateway.errors import invalid
from coalesce_tools.gateway.fields import boolean, integer, text_list

if TYPE_CHECKING:
    from coalesce_tools.gateway.app import Gateway


async def score(gateway: Gateway, model: ModelEntry, firsts: list[str], seconds: list[str], *, request_id: str,
                parameters: dict[str, Any]) -> np.ndarray:
    """One score per pair ``(firsts[i], seconds[i])``, float32."""
    limit = model.max_rows
    calls = []
    for lo in range(0, len(firsts), limit):
        tensors = {"TEXT": np.array(firsts[lo:lo + limit], dtype=object).reshape(-1, 1),
                   "TEXT_PAIR": np.array(seconds[lo:lo + limit], dtype=object).reshape(-1, 1)}
        calls.append(gateway.triton.infer(model.name, tensors, model.output, request_id=request_id,
                                          parameters=parameters))
    results = await asyncio.gather(*calls)
    scores = results[0] if len(results) == 1 else np.concatenate(results)
    return np.asarray(scores, dtype=np.float32).reshape(-1)


def _documents(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise invalid("'documents' must be a non-empty list of strings or of objects with 'text'", "documents")
    texts = []
    for index, item in enumerate(value):
        if isinstance(item, dict):
            item = item.get("text")
        if not isinstance(item, str):
            raise invalid(f"'documents[{index}]' must be a string or an object with a string 'text'", "documents")
        texts.append(item)
    return texts


def _usage(gateway: Gateway, model: ModelEntry, firsts: list[str], seconds: list[str]) -> int:
    tokenizer = model.text_tokenizer
    if model.settings.task.task == "similarity":
        # A bi-encoder reads each text alone, with its own special tokens.
        tokens = int(tokenizer.lengths(firsts).sum() + tokenizer.lengths(seconds).sum())
    else:
        tokens = int(tokenizer.lengths(firsts, seconds).sum())
    gateway.metrics.rows.labels(model.name).inc(len(firsts))
    gateway.metrics.tokens.labels(model.name, "prompt").inc(tokens)
    return tokens


async def handle_rerank(gateway: Gateway, body: dict[str, Any], request_id: str,
                        parameters: dict[str, Any]) -> dict[str, Any]:
    """The rerank response: results sorted by relevance, best first, ``top_n`` of them.

    Raises:
        ApiError: On a field that is wrong (400), an unknown model (404), or Triton's error.
    """
    model = await gateway.catalog.get(body.get("model"), RERANK)
    query = body.get("query")
    if not isinstance(query, str):
        raise invalid("'query' must be a string", "query")
    documents = _documents(body.get("documents"))
    top_n = integer(body, "top_n", low=1, default=len(documents))
    assert top_n is not None
    with_documents = boolean(body, "return_documents", default=True)
    queries = [query] * len(documents)
    scores = await score(gateway, model, queries, documents, request_id=request_id, parameters=parameters)
    order = np.argsort(-scores, kind="stable")[:top_n]
    results = []
    for index in order.tolist():
        result: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
        if with_documents:
            result["document"] = {"text": documents[index]}
        results.append(result)
    tokens = _usage(gateway, model, queries, documents)
    return {"id": request_id, "model": model.name, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "meta": {"billed_units": {"search_units": 1}}}


async def handle_score(gateway: Gateway, body: dict[str, Any], request_id: str,
                       parameters: dict[str, Any]) -> dict[str, Any]:
    """The score response (vLLM's shape): ``text_1`` against each ``text_2``, or pair by pair (lists of one length).

    Raises:
        ApiError: On a field that is wrong (400), an unknown model (404), or Triton's error.
    """
    model = await gateway.catalog.get(body.get("model"), RERANK)
    firsts, seconds = text_list(body.get("text_1"), "text_1"), text_list(body.get("text_2"), "text_2")
    if len(firsts) == 1 and len(seconds) > 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise invalid(f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: give one text_1 for many "
                      "text_2, or lists of one length (scored pair by pair)", "text_2")
    scores = await score(gateway, model, firsts, seconds, request_id=request_id, parameters=parameters)
    tokens = _usage(gateway, model, firsts, seconds)
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": model.name,
            "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores.tolist())],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
