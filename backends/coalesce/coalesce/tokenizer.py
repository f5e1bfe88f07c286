"""Tokenisation with Hugging Face ``tokenizers`` (Rust, batched, thread-parallel)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from coalesce.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EncodedRows:
    """Token ids of many rows, unpadded: row ``i`` is ``ids[offsets[i]:offsets[i+1]]``.

    Keeping rows ragged lets the coalescer pad each sub-batch only to its own
    longest row.
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

    def padded(self, rows: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Right-pad the given rows to ``length``: ``(input_ids, attention_mask, token_type_ids)``, int64."""
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
        return input_ids, mask, type_ids


class TextTokenizer:
    """A ``tokenizers`` tokenizer set to truncate, never pad (padding is the coalescer's job)."""

    def __init__(self, path: Path, max_sequence_length: int) -> None:
        """Load ``tokenizer.json`` and override its padding and truncation.

        The packaged MiniLM tokenizer ships fixed padding and truncation at 128;
        the model is served at ``max_sequence_length`` (256), so both are replaced.

        Raises:
            ConfigError: If the file is missing or unreadable.
        """
        if not path.is_file():
            raise ConfigError(f"tokenizer file not found: {path} (run `make setup` to export the model)")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise ConfigError(f"cannot load tokenizer {path}: {exc}") from exc
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=max_sequence_length)
        self.max_sequence_length = max_sequence_length

    def lengths(self, texts: Sequence[str]) -> np.ndarray:
        """Token count of each text (special tokens added, truncated), without keeping the ids."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=True)
        return np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))

    def encode(self, texts: Sequence[str]) -> EncodedRows:
        """Tokenise all texts in one batched call (special tokens added, truncated)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=True)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        ids = np.fromiter((t for e in encodings for t in e.ids), dtype=np.int64, count=total)
        type_ids = np.fromiter((t for e in encodings for t in e.type_ids), dtype=np.int64, count=total)
        return EncodedRows(ids=ids, type_ids=type_ids, offsets=offsets)
