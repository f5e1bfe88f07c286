"""Cutting rows into requests (sorted by length, within the model's bounds) and finding the concurrency."""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

_PIECE: Final = re.compile(r"\w+|[^\w\s]")
#: Rows counted at once by a tokenizer (bounds the memory of its encodings).
_TOKENIZER_BATCH: Final = 8192


def estimate_tokens(text: bytes) -> int:
    """A row's length for sorting without its tokenizer: its words and punctuation marks, plus two special tokens.

    WordPiece and BPE tokenizers split text at spaces and punctuation first, so this counts
    the pieces every row has at least; it sorts rows by token count far better than their
    bytes do (with the minilm tokenizer, 64-row runs of the queries workload pad 1.36x their
    real tokens sorted this way, 1.90x sorted by bytes, 1.04x by exact counts).
    """
    return len(_PIECE.findall(text.decode("utf-8"))) + 2


def row_lengths(texts: Sequence[bytes], pairs: Sequence[bytes] | None, *, tokenizer: Path | None = None,
                max_tokens: int | None = None) -> np.ndarray:
    """Each row's length in tokens (a pair's two texts together), capped at ``max_tokens`` (the model's truncation).

    Counted by ``tokenizer`` (a ``tokenizer.json``) where given, else estimated (``estimate_tokens``).
    """
    if tokenizer is None:
        lengths = np.array([estimate_tokens(t) for t in texts], dtype=np.int64)
        if pairs is not None:
            lengths += np.array([estimate_tokens(p) for p in pairs], dtype=np.int64)
    else:
        from tokenizers import Tokenizer

        counter = Tokenizer.from_file(str(tokenizer))
        # A tokenizer.json may carry padding and truncation of its own (the packaged MiniLM's pads to 128).
        counter.no_padding()
        if max_tokens:
            counter.enable_truncation(max_length=max_tokens, strategy="longest_first")
        else:
            counter.no_truncation()
        counts: list[int] = []
        for start in range(0, len(texts), _TOKENIZER_BATCH):
            chunk = [t.decode("utf-8") for t in texts[start:start + _TOKENIZER_BATCH]]
            batch: list[Any] = chunk
            if pairs is not None:
                batch = list(zip(chunk, [p.decode("utf-8") for p in pairs[start:start + _TOKENIZER_BATCH]],
                                 strict=True))
            # encode_batch_fast (tokenizers >= 0.21) skips the character offsets, which a count does not need.
            encode = getattr(counter, "encode_batch_fast", counter.encode_batch)
            encodings = encode(batch)
            counts.extend(len(e.ids) for e in encodings)
        lengths = np.array(counts, dtype=np.int64)
    return np.minimum(lengths, max_tokens) if max_tokens else lengths


def plan_requests(lengths: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray, *, max_rows: int,
                  max_bytes: int, max_tokens: int | None = None, seed: int | None = 0) -> list[np.ndarray]:
    """Row indices of each request: rows sorted by ``lengths``, cut into runs within every bound.

    ``lengths`` are the rows' tokens (the sort key), ``sizes`` their bytes. A request holds
    at most ``max_rows`` rows, ``max_bytes`` bytes and ``max_tokens`` padded tokens (rows x
    its longest row: one forward pass of the model's planner); a row over a bound alone goes
    alone (the server then says what is wrong with it).

    The requests are returned in a random order drawn from ``seed``, so that rows/s stays
    steady over a job rather than falling from the shortest rows to the longest, except that
    the cheapest tenth (by padded tokens) come last, in random order too: the job's last
    requests then finish close together instead of one long request keeping a server busy
    alone at the end. ``seed`` None: in length order.
    """
    if max_rows < 1 or max_bytes < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"max_rows, max_bytes and max_tokens must be at least 1, got {max_rows}, {max_bytes} "
                         f"and {max_tokens}")
    lengths = np.asarray(lengths, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    requests: list[np.ndarray] = []
    start, total = 0, 0
    for position, row in enumerate(order):
        size, rows = int(sizes[row]), position - start
        if rows and (rows >= max_rows or total + size > max_bytes
                     or (max_tokens is not None and (rows + 1) * int(lengths[row]) > max_tokens)):
            requests.append(order[start:position])
            start, total = position, 0
        total += size
    if start < len(order):
        requests.append(order[start:])
    if seed is None:
        return requests
    rng = random.Random(seed)
    cost = [len(r) * int(lengths[r[-1]]) for r in requests]  # padded tokens: the last row is the longest
    by_cost = sorted(range(len(requests)), key=lambda i: cost[i])
    tail = set(by_cost[:len(requests) // 10])
    body = [r for i, r in enumerate(requests) if i not in tail]
    end = [r for i, r in enumerate(requests) if i in tail]
    rng.shuffle(body)
    rng.shuffle(end)
    return body + end


class ConcurrencySearch:
    """Finds the number of requests in flight that gives the most work done per second, by measuring.

    Work is what the caller counts per answered request; a job counts padded tokens (rows x
    the request's longest row), so that a window of long rows and a window of short ones
    compare fairly. Hill-climbing: measure a window at the current concurrency, double it
    while a window gains at least ``gain`` over the best so far, then hold the best. While
    holding, every ``reprobe_windows`` windows it tries the next level up once more, so a
    server that got faster (a neighbour finished) is used. The first answers after a change
    were sent under the old concurrency and are not counted.

    Example:
        >>> search = ConcurrencySearch(start=2, maximum=16)
        >>> search.record(work=640, now=0.5)  # returns the concurrency to use from now on
        2
    """

    def __init__(self, start: int = 2, maximum: int = 32, *, gain: float = 1.05, window_s: float = 2.0,
                 min_requests: int = 4, reprobe_windows: int = 10) -> None:
        """A search from ``start`` requests in flight up to ``maximum``."""
        if not 1 <= start <= maximum:
            raise ValueError(f"need 1 <= start <= maximum, got start {start} and maximum {maximum}")
        if gain < 1 or window_s <= 0 or min_requests < 1 or reprobe_windows < 1:
            raise ValueError("gain must be >= 1, window_s > 0, min_requests and reprobe_windows >= 1")
        self.maximum, self.gain, self.window_s = maximum, gain, window_s
        self.min_requests, self.reprobe_windows = min_requests, reprobe_windows
        self.target = start
        self.best_target, self.best_rate = start, 0.0
        self.climbing = True
        self.history: list[tuple[int, float]] = []  # (concurrency, work/s) of every window
        self._held_windows = 0
        self._probing = False
        self._skip = 0
        self._window_start: float | None = None
        self._work = 0
        self._requests = 0

    def _change(self, target: int) -> None:
        self._skip = self.target if target != self.target else 0  # answers already in flight at the old level
        self.target = target
        self._window_start = None

    def record(self, work: int, now: float) -> int:
        """Count one answered request of ``work`` units at time ``now`` (seconds); returns the concurrency to use."""
        if self._skip > 0:
            self._skip -= 1
            if self._skip == 0:
                self._window_start = now
            return self.target
        if self._window_start is None:
            # The window opens at its first counted answer: the time before it was the pipeline filling.
            self._window_start, self._work, self._requests = now, 0, 0
            return self.target
        self._work += work
        self._requests += 1
        elapsed = now - self._window_start
        if elapsed < self.window_s or self._requests < max(self.min_requests, self.target):
            return self.target
        rate = self._work / elapsed
        self.history.append((self.target, rate))
        self._window_start, self._work, self._requests = now, 0, 0
        self._decide(rate)
        return self.target

    def _decide(self, rate: float) -> None:
        if self.climbing or self._probing:
            if rate >= self.best_rate * self.gain:
                self.best_target, self.best_rate = self.target, rate
                if self.target < self.maximum:
                    self._change(min(self.maximum, self.target * 2))
                    return
            self.climbing = self._probing = False
            self._held_windows = 0
            if self.target != self.best_target:
                self._change(self.best_target)
            return
        # Holding: the best level's rate follows the latest window, so a probe is compared with now, not then.
        self.best_rate = rate
        self._held_windows += 1
        if self._held_windows >= self.reprobe_windows and self.target < self.maximum:
            self._probing = True
            self._change(min(self.maximum, self.target * 2))

    def back_off(self) -> int:
        """Halve the concurrency after a server stopped answering; returns the new one."""
        self.climbing = self._probing = False
        self._held_windows = 0
        self.best_target = max(1, self.target // 2)
        self._change(self.best_target)
        return self.target


