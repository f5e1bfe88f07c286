"""The KV block pool: allocation, prefix sharing by chained digests, LRU eviction of cached prefixes."""

from __future__ import annotations

import pytest

from coalesce.generation.blocks import BlockPool, prefix_digests


def test_digests_name_whole_prefixes_not_single_blocks():
    a = prefix_digests([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_digests([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(prefix_digests([1, 2, 3], 4)) == 0
    assert a[1] != b[1], "the same block after a different prefix must not match"
    assert prefix_digests([1, 2, 3, 4, 0], 4)[0] == a[0]


def test_allocation_reserves_every_block_and_refuses_when_full():
    pool = BlockPool(4, 4)
    first = pool.allocate(9, [])
    assert first is not None and len(first.blocks) == 3 and first.cached_tokens == 0
    assert pool.allocate(5, []) is None, "2 blocks needed, 1 free"
    assert pool.usage().free == 1
    pool.release(first.blocks)
    assert pool.usage().free == 4


def test_computed_prefix_blocks_are_shared_and_counted():
    pool = BlockPool(8, 4)
    digests = prefix_digests(list(range(12)), 4)
    first = pool.allocate(16, digests[:2])
    assert first is not None and first.cached_tokens == 0
    for block, digest in zip(first.blocks, digests, strict=False):
        pool.register(block, digest)
    second = pool.allocate(16, digests[:2])
    assert second is not None and second.cached_tokens == 8
    assert second.blocks[:2] == first.blocks[:2] and set(second.blocks[2:]).isdisjoint(first.blocks)
    pool.release(first.blocks)
    assert pool.usage().used == 4, "the shared blocks are still held by the second sequence"


def test_released_prefixes_stay_cached_and_are_evicted_least_recently_used_first():
    pool = BlockPool(4, 2)
    old, new = prefix_digests([1, 1], 2), prefix_digests([2, 2], 2)
    for digests in (old, new):
        allocation = pool.allocate(2, [])
        assert allocation is not None
        pool.register(allocation.blocks[0], digests[0])
        pool.release(allocation.blocks)
    assert pool.usage().cached == 2 and pool.usage().free == 2
    big = pool.allocate(6, [])  # 3 blocks: 2 free, then the least recently released cached one
    assert big is not None and pool.evictions == 1
    assert pool.match(old) == [] and len(pool.match(new)) == 1
    assert pool.allocate(2, new) is not None, "reviving a cached block needs no free one"


def test_a_duplicate_digest_keeps_the_first_block():
    pool = BlockPool(4, 2)
    digest = prefix_digests([5, 5], 2)
    a, b = pool.allocate(2, []), pool.allocate(2, [])
    assert a is not None and b is not None
    pool.register(a.blocks[0], digest[0])
    pool.register(b.blocks[0], digest[0])
    pool.release(b.blocks)
    assert pool.usage().free == 3, "the duplicate is not cached"
    assert pool.match(digest) == a.blocks[:1]


def test_without_prefix_cache_nothing_is_shared():
    pool = BlockPool(4, 2, prefix_cache=False)
    allocation = pool.allocate(2, [])
    assert allocation is not None
    digest = prefix_digests([3, 3], 2)
    pool.register(allocation.blocks[0], digest[0])
    assert pool.match(digest) == []


def test_a_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0, 16)
