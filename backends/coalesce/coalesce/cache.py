"""Row-level result cache: stable keys and an in-process LRU bounded in bytes.

Keys: ``output_fingerprint`` hashes everything that decides a row's embedding (model
name and version, the weights' and tokenizer's content, truncation, pooling,
normalisation, runtime and precision) once at load; ``row_key`` then hashes one row's
text under that fingerprint. Any change of those inputs gives other keys, so a cache
(in process or shared between servers) can never answer with an old result.

``RowCache`` is the in-process tier: least-recently-used eviction under a byte bound
that counts each entry's vector, key and bookkeeping, an optional time to live, and a
lock, so concurrent ``execute`` calls (several model instances share nothing, but one
instance's threads may) see a consistent cache. Its counters feed the metrics.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

#: Bytes a cached row costs besides its vector's data and key digest: the LRU's node, the
#: entry tuple, the ndarray header and the key object. Measured with tracemalloc on CPython
#: 3.11 over 20,000 entries of 384 floats: 267 bytes plus the 49-byte key object, rounded up.
ENTRY_OVERHEAD_BYTES: Final = 320
#: Bytes of one row key (BLAKE2b digest).
KEY_BYTES: Final = 16


def file_digest(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 of a file's content, hex."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def output_fingerprint(fields: Mapping[str, Any]) -> bytes:
    """A 32-byte digest of everything that decides a row's output.

    ``fields`` holds JSON-serialisable values (model name, version, weight and tokenizer
    digests, truncation, pooling, normalisation, runtime, precision); the encoding is
    canonical (sorted keys), so equal fields give equal fingerprints in every process.
    """
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).digest()


def row_key(fingerprint: bytes, text: str) -> bytes:
    """The cache key of one row: a keyed BLAKE2b of its UTF-8 text under the output fingerprint."""
    return hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=KEY_BYTES,
                           key=fingerprint[:64]).digest()


@dataclasses.dataclass
class CacheStats:
    """Cumulative counts of one cache."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0
    too_large: int = 0


class RowCache:
    """An LRU of row vectors bounded in bytes, with an optional time to live; thread-safe.

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
        self._entries: collections.OrderedDict[bytes, tuple[np.ndarray, float, int]] = collections.OrderedDict()
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
    def entry_bytes(vector: np.ndarray) -> int:
        """What one entry counts against the bound."""
        return int(vector.nbytes) + KEY_BYTES + ENTRY_OVERHEAD_BYTES

    def get_many(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        """The cached vector of each key (read-only), or None; a hit becomes the most recently used."""
        found: list[np.ndarray | None] = []
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

    def put_many(self, keys: Sequence[bytes], vectors: np.ndarray) -> int:
        """Store one vector per key (row ``i`` of ``vectors`` under ``keys[i]``), evicting the least recently used.

        Vectors are copied, so later changes to ``vectors`` never reach the cache; an
        entry larger than the whole bound is not stored. Returns how many entries were evicted.
        """
        if not self.enabled:
            return 0
        if len(keys) != len(vectors):
            raise ValueError(f"{len(keys)} keys for {len(vectors)} vectors")
        expires = self._clock() + self.ttl_s if self.ttl_s else float("inf")
        evicted = 0
        with self._lock:
            for key, row in zip(keys, vectors, strict=True):
                vector = np.array(row, dtype=np.float32, copy=True)
                vector.flags.writeable = False
                size = self.entry_bytes(vector)
                if size > self.max_bytes:
                    self.stats.too_large += 1
                    continue
                if key in self._entries:
                    self._drop(key)
                while self._resident + size > self.max_bytes:
                    oldest = next(iter(self._entries))
                    self._drop(oldest)
                    evicted += 1
                self._entries[key] = (vector, expires, size)
                self._resident += size
            self.stats.evictions += evicted
        return evicted

    def _drop(self, key: bytes) -> None:
        _, _, size = self._entries.pop(key)
        self._resident -= size
