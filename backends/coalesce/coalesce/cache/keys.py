"""Row-cache keys that can never answer with an old or another model's result.

``output_fingerprint`` hashes everything that decides a row's outputs once at load
(model name and version, the content of every file the model reads, the task and its
output-affecting settings, the runtime and its precision); ``row_key`` then hashes one
row's canonical bytes (the task's ``row_bytes``: every input of the row, with its
dtype and shape) under that fingerprint. Any change of those inputs gives other keys,
so a cache, in process or shared between servers, never serves a stale row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

#: Bytes of one row key (BLAKE2b digest).
KEY_BYTES: Final = 16


def file_digest(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 of a file's content (of every file under it, for a folder), hex."""
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode("utf-8") + b"\x00")
        with file.open("rb") as handle:
            while chunk := handle.read(chunk_bytes):
                digest.update(chunk)
    return digest.hexdigest()


def output_fingerprint(fields: Mapping[str, Any]) -> bytes:
    """A 32-byte digest of everything that decides a row's outputs.

    ``fields`` holds JSON-serialisable values; the encoding is canonical (sorted keys),
    so equal fields give equal fingerprints in every process.
    """
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).digest()


def row_key(fingerprint: bytes, row_bytes: bytes) -> bytes:
    """The cache key of one row: a keyed BLAKE2b of its canonical bytes under the output fingerprint."""
    return hashlib.blake2b(row_bytes, digest_size=KEY_BYTES, key=fingerprint[:64]).digest()
