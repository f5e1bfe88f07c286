"""Pooling of token states into one vector per row."""

from __future__ import annotations

import numpy as np


def pool(hidden: np.ndarray, mask: np.ndarray, *, mode: str, normalize: bool) -> np.ndarray:
    """Pool ``[rows, tokens, dim]`` states to ``[rows, dim]`` float32.

    Args:
        hidden: Last hidden states.
        mask: ``[rows, tokens]`` attention mask; padding positions are 0.
        mode: ``mean`` (over unmasked tokens, as sentence-transformers) or ``cls``.
        normalize: L2-normalise each row.
    """
    if mode == "cls":
        pooled = hidden[:, 0, :].astype(np.float32, copy=True)
    else:
        weights = mask.astype(np.float32)[:, :, None]
        summed = (hidden * weights).sum(axis=1)
        # sentence-transformers clamps the count at 1e-9; a row always has [CLS] and [SEP].
        counts = np.clip(weights.sum(axis=1), 1e-9, None)
        pooled = (summed / counts).astype(np.float32, copy=False)
    if normalize:
        norms = np.linalg.norm(pooled, axis=1, keepdims=True)
        pooled = pooled / np.clip(norms, 1e-12, None)
    return np.ascontiguousarray(pooled, dtype=np.float32)
