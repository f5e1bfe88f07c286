"""Generated tokens to text, incrementally: new text per token, stop strings, and what a stream may send yet.

Decoding a token alone can give the wrong text (a byte of a multi-byte character, or a
word-start marker the tokenizer drops at the start of a text), so each new token is
decoded together with the few before it and only the difference is taken, as
text-generation-inference and vLLM do. Text ending in an incomplete character waits
for the next token. With stop strings, a stream holds back the text that could still
become the start of one.
"""

from __future__ import annotations

from typing import Protocol

#: Tokens decoded before the new ones, so the new text is cut out of a decoded context.
CONTEXT_TOKENS = 5
REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """What a tokenizer offers here (``tokenizers.Tokenizer`` has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``."""
        ...


class IncrementalText:
    """The text of one sequence's generated tokens, grown one token at a time."""

    def __init__(self, decoder: Decoder, stop: tuple[str, ...] = (), *, stop_after_tokens: int = 0) -> None:
        """Decode with ``decoder``; finish at the first of ``stop`` (which is left out of the text).

        Stop strings are looked for only in text that comes after ``stop_after_tokens``
        tokens (a request's ``min_tokens``).
        """
        self._decoder = decoder
        self._stop_after_tokens = stop_after_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._sent = 0
        self.stopped = False

    def add(self, token: int) -> None:
        """Append a generated token; sets ``stopped`` (and cuts ``text`` before it) when a stop string appears."""
        self._ids.append(token)
        prefix = self._decoder.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decoder.decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return  # no complete character yet
        searched_from = max(len(self.text) - self._holdback, 0)
        self.text += full[len(prefix):]
        self._prefix_offset = max(len(self._ids) - CONTEXT_TOKENS, 0)
        self._read_offset = len(self._ids)
        if self._stop and len(self._ids) >= self._stop_after_tokens:
            cut = min((i for i in (self.text.find(s, searched_from) for s in self._stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True

    def finish(self) -> None:
        """The sequence ended: keep whatever its last tokens decode to, even an incomplete character."""
        if self.stopped or self._read_offset == len(self._ids):
            return
        prefix = self._decoder.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decoder.decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix):
            self.text += full[len(prefix):]
        self._read_offset = len(self._ids)

    def take(self, *, final: bool) -> str:
        """Text not yet sent: all of it when ``final``, else what can no longer turn into a stop string."""
        end = len(self.text) if final or self.stopped else max(len(self.text) - self._holdback, self._sent)
        piece = self.text[self._sent:end]
        self._sent = end
        return piece
