"""The in-process row cache: an LRU of row outputs bounded in bytes, with an optional time to live.

Least-recently-used eviction under a byte bound that counts each entry's arrays, key and
bookkeeping, an optional time to live, and a lock, so the threads of one instance (the
scheduler's, the metrics flusher's, ``execute``'s) see a consistent cache. Its counters
feed the metrics. An entry is one row's outputs: one array per model output, in the
order the task declares them.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from coalesce.cache.keys import KEY_BYTES

#: Bytes a cached row costs besides its arrays' data and key digest: the LRU's node, the
#: entry tuple, the ndarray header and the key object. Measured with tracemalloc on CPython
#: 3.11 over 20,000 entries of 384 floats: 267 bytes plus the 49-byte key object, rounded up.
ENTRY_OVERHEAD_BYTES: Final = 320
#: What one cached row holds: its outputs, in the task's output order.
RowOutputs = tuple[np.ndarray, ...]


@dataclasses.dataclass
class CacheStats:
    """Cumulative counts of one cache."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0
    too_large: int = 0


class RowCache:
    """An LRU of row outputs bounded in bytes, with an optional time to live; thread-safe.

    ``max_bytes == 0`` disables it: every lookup misses and nothing is stored.
    """

    def __init__(self, max_bytes: int, *, ttl_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        """An empty cache holding at most ``max_bytes`` (entries expire ``ttl_s`` after being stored; 0: never).

        Raises:
            ValueError: If ``max_bytes`` or ``ttl_s`` is negative.
        """
        if max_bytes < 0 or ttl_s < 0:
            raise ValueError(f"max_bytes and ttl_s must be >= 0, got {max_bytes} and {ttl_s}")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: collections.OrderedDict[bytes, tuple[RowOutputs, float, int]] = collections.OrderedDict()
        self._resident = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @property
    def enabled(self) -> bool:
        """Whether the cache stores anything."""
        return self.max_bytes > 0

    @property
    def resident_bytes(self) -> int:
        """Bytes the cache holds now, by the same count as the bound."""
        return self._resident

    def __len__(self) -> int:
        """Entries held now."""
        return len(self._entries)

    @staticmethod
    def entry_bytes(outputs: RowOutputs) -> int:
        """What one entry counts against the bound."""
        return sum(int(a.nbytes) for a in outputs) + KEY_BYTES + ENTRY_OVERHEAD_BYTES * len(outputs)

    def get_many(self, keys: Sequence[bytes]) -> list[RowOutputs | None]:
        """The cached outputs of each key (read-only arrays), or None; a hit becomes the most recently used."""
        found: list[RowOutputs | None] = []
        if not self.enabled:
            with self._lock:
                self.stats.misses += len(keys)
            return [None] * len(keys)
        now = self._clock()
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and self.ttl_s and entry[1] <= now:
                    self._drop(key)
                    self.stats.expirations += 1
                    entry = None
                if entry is None:
                    self.stats.misses += 1
                    found.append(None)
                    continue
                self._entries.move_to_end(key)
                self.stats.hits += 1
                found.append(entry[0])
        return found

    def put_many(self, keys: Sequence[bytes], rows: Sequence[RowOutputs]) -> int:
        """Store one row's outputs per key (``rows[i]`` under ``keys[i]``), evicting the least recently used.

        Arrays are copied, so later changes to ``rows`` never reach the cache; an entry
        larger than the whole bound is not stored. Returns how many entries were evicted.
        """
        if not self.enabled:
            return 0
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys for {len(rows)} rows")
        expires = self._clock() + self.ttl_s if self.ttl_s else float("inf")
        evicted = 0
        with self._lock:
            for key, row in zip(keys, rows, strict=True):
                outputs = tuple(_frozen(a) for a in row)
                size = self.entry_bytes(outputs)
                if size > self.max_bytes:
                    self.stats.too_large += 1
                    continue
                if key in self._entries:
                    self._drop(key)
                while self._resident + size > self.max_bytes:
                    oldest = next(iter(self._entries))
                    self._drop(oldest)
                    evicted += 1
                self._entries[key] = (outputs, expires, size)
                self._resident += size
            self.stats.evictions += evicted
        return evicted

    def _drop(self, key: bytes) -> None:
        _, _, size = self._entries.pop(key)
        self._resident -= size


def _frozen(array: np.ndarray) -> np.ndarray:
    copy = np.array(array, copy=True)
    copy.flags.writeable = False
    return copy
