"""Choosing each sequence's next token from its logits: greedy at temperature 0, else seeded sampling.

Each sequence samples with its own generator (seeded from ``seed`` when the request
gives one), one draw per token, so a seeded request gives the same text alone and
batched with any neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from coalesce.generation.request import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> list[int]:
    """The next token of each row of ``logits`` (``[rows, vocab]``, float32 on the CPU)."""
    tokens: list[int] = []
    greedy = logits.argmax(dim=-1).tolist() if len(params) else []
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.temperature == 0 or generator is None:
            tokens.append(int(greedy[row]))
            continue
        scores = logits[row] / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            before = torch.cumsum(ordered, dim=-1) - ordered
            ordered = ordered.masked_fill(before >= p.top_p, 0.0)  # keep the smallest set reaching top_p
            probs = torch.zeros_like(probs).scatter_(0, order, ordered)
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens
