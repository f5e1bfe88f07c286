"""Tokenisation with Hugging Face ``tokenizers`` (Rust, batched, thread-parallel), for texts and text pairs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from coalesce.core.errors import ConfigError

#: Runtime inputs a text model may take, in the order they are assembled.
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
TOKEN_TYPE_IDS = "token_type_ids"
TEXT_GRAPH_INPUTS = (INPUT_IDS, ATTENTION_MASK, TOKEN_TYPE_IDS)


@dataclasses.dataclass(frozen=True)
class EncodedRows:
    """Token ids of many rows, unpadded: row ``i`` is ``ids[offsets[i]:offsets[i+1]]``.

    Keeping rows ragged lets the coalescer pad each pass only to its own longest row.
    """

    ids: np.ndarray
    type_ids: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        """Token count of each row."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def padded(self, rows: np.ndarray, length: int, names: Sequence[str] = TEXT_GRAPH_INPUTS) -> dict[str, np.ndarray]:
        """Right-pad the given rows to ``length``: the graph inputs ``names`` (of ``TEXT_GRAPH_INPUTS``), int64."""
        count = len(rows)
        input_ids = np.zeros((count, length), dtype=np.int64)
        type_ids = np.zeros((count, length), dtype=np.int64)
        mask = np.zeros((count, length), dtype=np.int64)
        for out_row, row in enumerate(rows):
            lo, hi = self.offsets[row], self.offsets[row + 1]
            n = hi - lo
            input_ids[out_row, :n] = self.ids[lo:hi]
            type_ids[out_row, :n] = self.type_ids[lo:hi]
            mask[out_row, :n] = 1
        every = {INPUT_IDS: input_ids, ATTENTION_MASK: mask, TOKEN_TYPE_IDS: type_ids}
        return {name: every[name] for name in names}


class TextTokenizer:
    """A ``tokenizers`` tokenizer set to truncate, never pad (padding is the coalescer's job)."""

    def __init__(self, path: Path, max_sequence_length: int) -> None:
        """Load ``tokenizer.json`` and override its padding and truncation.

        Files often ship a fixed padding and their own truncation (the packaged MiniLM:
        both at 128); the model is served at ``max_sequence_length``, so both are
        replaced. Pairs are truncated longest first, as ``transformers`` does by default.

        Raises:
            ConfigError: If the file is missing or unreadable.
        """
        if not path.is_file():
            raise ConfigError(f"tokenizer file not found: {path} (run `make setup`, or put the model's "
                              "tokenizer.json there)")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise ConfigError(f"cannot load tokenizer {path}: {exc}") from exc
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=max_sequence_length, strategy="longest_first")
        self.max_sequence_length = max_sequence_length
        self.vocab_size = self._tokenizer.get_vocab_size()

    def _encodings(self, texts: Sequence[str], pairs: Sequence[str | None] | None) -> list[Encoding]:
        if pairs is None or all(p is None for p in pairs):
            return self._tokenizer.encode_batch(list(texts), add_special_tokens=True)
        if any(p is None for p in pairs):
            # Mixed rows: pairs and single texts tokenised apart, then put back in order.
            out: list[Encoding] = [None] * len(texts)  # type: ignore[list-item]
            single = [i for i, p in enumerate(pairs) if p is None]
            double = [i for i, p in enumerate(pairs) if p is not None]
            for i, e in zip(single, self._tokenizer.encode_batch([texts[i] for i in single]), strict=True):
                out[i] = e
            for i, e in zip(double, self._tokenizer.encode_batch([(texts[i], pairs[i]) for i in double]),
                            strict=True):
                out[i] = e
            return out
        return self._tokenizer.encode_batch(list(zip(texts, pairs, strict=True)), add_special_tokens=True)

    def lengths(self, texts: Sequence[str], pairs: Sequence[str | None] | None = None) -> np.ndarray:
        """Token count of each text or pair (special tokens added, truncated), without keeping the ids."""
        encodings = self._encodings(texts, pairs)
        return np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))

    def encode(self, texts: Sequence[str], pairs: Sequence[str | None] | None = None) -> EncodedRows:
        """Tokenise all texts (or pairs) in one batched call (special tokens added, truncated)."""
        encodings = self._encodings(texts, pairs)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        ids = np.fromiter((t for e in encodings for t in e.ids), dtype=np.int64, count=total)
        type_ids = np.fromiter((t for e in encodings for t in e.type_ids), dtype=np.int64, count=total)
        return EncodedRows(ids=ids, type_ids=type_ids, offsets=offsets)
