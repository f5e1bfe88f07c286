"""The KV-cache pool's bookkeeping: fixed-size blocks, shared prompt prefixes, LRU eviction.

The pool is ``num_blocks`` blocks of ``block_tokens`` token slots each (the tensors are
allocated in ``coalesce.generation.engine`` and read in ``coalesce.generation.attention``;
this module only hands out block numbers). A sequence takes every block its prompt and
``max_tokens`` can fill when it joins, so a running sequence never waits for memory. A full
block of prompt tokens is named by a digest of its tokens chained to the previous block's
digest (the digest names the whole prefix up to it); once computed, a later prompt with the
same prefix takes the same block instead of computing it again. Blocks no sequence holds but
that name a prefix stay cached and are reused in least-recently-released order when the free
list runs out.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

#: Digest of the empty prefix, the chain's start.
ROOT_DIGEST = b"\x00" * 16


def prefix_digests(tokens: Sequence[int], block_tokens: int, *, salt: bytes = b"") -> list[bytes]:
    """The digest of each full block of ``tokens``, each chained to the one before (so it names the whole prefix)."""
    digests = []
    previous = hashlib.blake2b(salt, digest_size=16).digest() if salt else ROOT_DIGEST
    array = np.asarray(tokens, dtype=np.int64)
    for start in range(0, len(array) - block_tokens + 1, block_tokens):
        previous = hashlib.blake2b(previous + array[start:start + block_tokens].tobytes(), digest_size=16).digest()
        digests.append(previous)
    return digests


@dataclasses.dataclass
class Allocation:
    """The blocks of one sequence, in order, and how many leading tokens were found computed (prefix hits)."""

    blocks: list[int]
    cached_tokens: int


@dataclasses.dataclass(frozen=True)
class PoolUsage:
    """Blocks held by sequences, cached for reuse (held by none), and free."""

    used: int
    cached: int
    free: int


class BlockPool:
    """Hands out KV-cache blocks, shares computed prompt prefixes, evicts cached ones least recently used first.

    Not thread-safe: the generation engine's step thread is its one user.
    """

    def __init__(self, num_blocks: int, block_tokens: int, *, prefix_cache: bool = True) -> None:
        """A pool of ``num_blocks`` blocks of ``block_tokens`` tokens; ``prefix_cache`` False: never share."""
        if num_blocks < 1 or block_tokens < 1:
            raise ValueError(f"a pool needs at least one block of one token (got {num_blocks} x {block_tokens})")
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self.prefix_cache = prefix_cache
        self._refs = [0] * num_blocks
        self._digest_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        #: Blocks held by no sequence that name a computed prefix, least recently released first.
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.evictions = 0

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` tokens."""
        return -(-tokens // self.block_tokens)

    def usage(self) -> PoolUsage:
        """How many blocks are held, cached and free."""
        cached, free = len(self._cached), len(self._free)
        return PoolUsage(used=self.num_blocks - cached - free, cached=cached, free=free)

    def match(self, digests: Sequence[bytes]) -> list[int]:
        """The computed blocks naming the leading prefixes among ``digests`` (stops at the first unknown)."""
        found: list[int] = []
        if not self.prefix_cache:
            return found
        for digest in digests:
            block = self._block_of.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def allocate(self, total_tokens: int, digests: Sequence[bytes]) -> Allocation | None:
        """Blocks for a sequence of up to ``total_tokens`` tokens, reusing computed prefix blocks; None if full.

        ``digests`` are those of the prompt's full blocks that may be reused: the caller
        leaves out any block holding the prompt's last token, which must be computed for
        its logits.
        """
        shared = self.match(digests)
        needed = self.blocks_for(total_tokens) - len(shared)
        revived = sum(1 for block in shared if block in self._cached)
        if needed > len(self._free) + len(self._cached) - revived:
            return None
        for block in shared:
            self._cached.pop(block, None)
            self._refs[block] += 1
        fresh = [self._take() for _ in range(needed)]
        for block in fresh:
            self._refs[block] = 1
        return Allocation(blocks=shared + fresh, cached_tokens=len(shared) * self.block_tokens)

    def register(self, block: int, digest: bytes) -> None:
        """Name ``block`` (now computed, full of prompt tokens) by ``digest`` so later prompts can reuse it.

        A digest already naming another block (two equal prompts computed in the same
        step) keeps its first block; this one stays private and is freed with its sequence.
        """
        if not self.prefix_cache or digest in self._block_of or self._digest_of[block] is not None:
            return
        self._block_of[digest] = block
        self._digest_of[block] = digest

    def release(self, blocks: Sequence[int]) -> None:
        """A sequence gives back its blocks: named ones stay cached, the others are free again."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if self._digest_of[block] is not None:
                self._cached[block] = None
            else:
                self._free.append(block)

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._cached.popitem(last=False)
        digest = self._digest_of[block]
        if digest is not None:
            del self._block_of[digest]
            self._digest_of[block] = None
        self.evictions += 1
        return block
