"""What the generation engine answers a request with; light enough for the Triton adapter to import."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Final

from coalesce.core.errors import CoalesceError

#: Why a sequence ended (vLLM's names): end of sequence or a stop string, or its length limit.
FINISH_STOP: Final = "stop"
FINISH_LENGTH: Final = "length"


@dataclasses.dataclass(frozen=True)
class GenerationEvent:
    """New text (streamed) or all of it, or an error; ``final`` ends the request.

    ``new_tokens``: tokens generated since the previous response (all of them in a
    request's only response); ``logprobs``: one entry per such token (vLLM's shape:
    ``{token id: {"logprob", "rank", "decoded_token"}}``), where the request asked;
    ``cumulative_logprob``: the sum over every token so far.
    """

    text: str = ""
    final: bool = False
    finish_reason: str | None = None
    error: CoalesceError | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0
    new_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: tuple[dict[str, dict[str, Any]], ...] = ()
    #: The request as read (``contract.GenerationRequest``: which outputs it asked for); None on a refusal.
    request: Any = None


#: Receives a request's events, from the engine's step thread.
Sink = Callable[[GenerationEvent], None]
