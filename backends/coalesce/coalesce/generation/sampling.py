"""Choosing each sequence's next token from its logits, for every sequence of a step at once.

One step's rows go through batched tensor operations: masks (end of sequence and
``stop_token_ids`` before ``min_tokens``, structured-output bitmasks), penalties
(repetition over prompt and output, presence and frequency over the output, as vLLM
applies them), then temperature, top-k and top-p, and the draw. Greedy rows take the
argmax of the processed logits. Each sampling row draws with its own generator (seeded
from ``seed`` where the request gives one), as an exponential race over its
probabilities (``argmax(p / q)``, ``q ~ Exp(1)``, the same distribution as a
multinomial draw), so a seeded request gives the same text alone and batched with any
neighbours. Log probabilities are the model's own (log-softmax of the raw logits, before
any processing: vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from coalesce.generation.contract import SamplingParams


class Penalties:
    """One sequence's token counts for its penalties, kept up to date token by token (``[vocab]`` each)."""

    def __init__(self, prompt: Sequence[int], vocab_size: int) -> None:
        """Mark the prompt's tokens (the repetition penalty covers them); no output yet."""
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        self.seen[torch.as_tensor([t for t in prompt if t < vocab_size], dtype=torch.long)] = True

    def add(self, token: int) -> None:
        """Count one generated token."""
        if token < self.output_counts.shape[0]:
            self.output_counts[token] += 1
            self.seen[token] = True


@dataclasses.dataclass
class Row:
    """What sampling needs of one sequence this step."""

    params: SamplingParams
    generator: torch.Generator | None
    penalties: Penalties | None = None
    #: Token ids masked this step (end of sequence and stop_token_ids before min_tokens).
    banned: tuple[int, ...] = ()
    #: Top tokens to report with the sampled one's log probability (None: no log probability needed).
    logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The sampled token of one row; with its log probability, rank and the top tokens where the row asked."""

    token: int
    logprob: float = 0.0
    rank: int = 0
    top: tuple[tuple[int, float], ...] = ()


@torch.inference_mode()
def sample(logits: torch.Tensor, rows: Sequence[Row]) -> list[Choice]:
    """The next token of each row of ``logits`` (``[rows, vocab]``, float32 on the CPU; changed in place)."""
    if not rows:
        return []
    wanting = [i for i, row in enumerate(rows) if row.logprobs is not None]
    logprobs = torch.log_softmax(logits[wanting], dim=-1) if wanting else None
    _ban(logits, rows)
    _penalise(logits, rows)
    tokens = logits.argmax(dim=-1)
    drawing = [i for i, row in enumerate(rows) if row.params.temperature > 0 and row.generator is not None]
    if drawing:
        tokens[drawing] = _draw(logits[drawing], [rows[i] for i in drawing])
    chosen = tokens.tolist()
    choices = [Choice(int(t)) for t in chosen]
    if logprobs is not None:
        picked = torch.as_tensor([chosen[i] for i in wanting], dtype=torch.long)
        own = logprobs.gather(1, picked[:, None])
        ranks = (logprobs > own).sum(dim=-1) + 1
        most = max(rows[i].logprobs or 0 for i in wanting)
        top_values, top_ids = logprobs.topk(most, dim=-1) if most else (None, None)
        for k, i in enumerate(wanting):
            count = rows[i].logprobs or 0
            top = () if top_ids is None or not count else tuple(
                zip(top_ids[k, :count].tolist(), top_values[k, :count].tolist(), strict=True))  # type: ignore[index]
            choices[i] = Choice(chosen[i], float(own[k, 0]), int(ranks[k]), top)
    return choices


def _ban(logits: torch.Tensor, rows: Sequence[Row]) -> None:
    pairs = [(i, token) for i, row in enumerate(rows) for token in row.banned if token < logits.shape[1]]
    if pairs:
        index = torch.as_tensor(pairs, dtype=torch.long)
        logits[index[:, 0], index[:, 1]] = float("-inf")


def _penalise(logits: torch.Tensor, rows: Sequence[Row]) -> None:
    penalised = [i for i, row in enumerate(rows) if row.penalties is not None]
    if not penalised:
        return
    states = [rows[i].penalties for i in penalised]
    params = [rows[i].params for i in penalised]
    counts = torch.stack([s.output_counts for s in states])  # type: ignore[union-attr]
    seen = torch.stack([s.seen for s in states])  # type: ignore[union-attr]
    scores = logits[penalised]
    repetition = torch.tensor([p.repetition_penalty for p in params])[:, None]
    scores = torch.where(seen, torch.where(scores > 0, scores / repetition, scores * repetition), scores)
    frequency = torch.tensor([p.frequency_penalty for p in params])[:, None]
    presence = torch.tensor([p.presence_penalty for p in params])[:, None]
    scores -= frequency * counts + presence * (counts > 0)
    logits[penalised] = scores


def _draw(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """One token per row: temperature, top-k and top-p over the whole batch, then each row's own draw."""
    scores = logits / torch.tensor([row.params.temperature for row in rows])[:, None]
    top_k = [row.params.top_k for row in rows]
    top_p = [row.params.top_p for row in rows]
    vocab = scores.shape[1]
    if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        ordered, order = scores.sort(dim=-1, descending=True)
        keep_k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])[:, None]
        ordered.masked_fill_(torch.arange(vocab)[None, :] >= keep_k, float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        ordered.masked_fill_(before >= torch.tensor(top_p)[:, None], float("-inf"))  # the first token always stays
        scores = torch.empty_like(scores).scatter_(1, order, ordered)
    probs = torch.softmax(scores, dim=-1)
    noise = torch.stack([torch.empty(vocab).exponential_(generator=row.generator) for row in rows])
    return (probs / noise).argmax(dim=-1)
