"""What the generation engine answers a request with; light enough for the Triton adapter to import."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Final

from coalesce.core.errors import CoalesceError

#: Why a sequence ended (vLLM's names): end of sequence or a stop string, or its length limit.
FINISH_STOP: Final = "stop"
FINISH_LENGTH: Final = "length"


@dataclasses.dataclass(frozen=True)
class GenerationEvent:
    """New text (streamed) or all of it, or an error; ``final`` ends the request."""

    text: str = ""
    final: bool = False
    finish_reason: str | None = None
    error: CoalesceError | None = None
    prompt_tokens: int = 0
    generated_tokens: int = 0


#: Receives a request's events, from the engine's step thread.
Sink = Callable[[GenerationEvent], None]
