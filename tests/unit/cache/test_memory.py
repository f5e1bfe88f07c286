"""The in-process row cache: bit-identical, read-only hits of every output of a row, LRU under a byte bound, TTL."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce.cache.keys import KEY_BYTES
from coalesce.cache.memory import ENTRY_OVERHEAD_BYTES, RowCache

DIM = 384


def row(seed, width=DIM):
    """One row's outputs: a vector, as the embedding task gives."""
    return (np.random.default_rng(seed).standard_normal(width).astype(np.float32),)


def rows(*seeds):
    return [row(seed) for seed in seeds]


def test_hits_are_bit_identical_and_read_only():
    cache = RowCache(1 << 20)
    keys = [b"a" * 16, b"b" * 16]
    stored = rows(0, 1)
    cache.put_many(keys, stored)
    stored[0][0][0] += 1.0  # the caller's array changing later must not reach the cache
    got = cache.get_many([keys[1], b"c" * 16, keys[0]])
    assert got[1] is None
    assert got[0][0].tobytes() == row(1)[0].tobytes() and got[2][0].tobytes() == row(0)[0].tobytes()
    with pytest.raises(ValueError):
        got[0][0][0] = 0.0
    assert (cache.stats.hits, cache.stats.misses) == (2, 1)


def test_a_row_of_several_outputs_comes_back_whole():
    cache = RowCache(1 << 20)
    outputs = (np.arange(12, dtype=np.float32).reshape(4, 3), np.array([1.5, 4.0]), np.array([7], dtype=np.int64))
    cache.put_many([b"k" * 16], [outputs])
    (got,) = cache.get_many([b"k" * 16])
    assert len(got) == 3
    for want, have in zip(outputs, got, strict=True):
        assert have.dtype == want.dtype and have.shape == want.shape and have.tobytes() == want.tobytes()
    assert RowCache.entry_bytes(outputs) == 48 + 16 + 8 + KEY_BYTES + 3 * ENTRY_OVERHEAD_BYTES
    assert cache.resident_bytes == RowCache.entry_bytes(outputs)


def test_least_recently_used_is_evicted_first():
    one = RowCache.entry_bytes(row(0))
    cache = RowCache(3 * one)
    for i in range(3):
        cache.put_many([bytes([i]) * 16], rows(i))
    cache.get_many([bytes([0]) * 16])  # 0 becomes the most recent; 1 is now the oldest
    assert cache.put_many([bytes([3]) * 16], rows(3)) == 1
    assert [v is not None for v in cache.get_many([bytes([i]) * 16 for i in range(4)])] == [True, False, True, True]
    assert cache.stats.evictions == 1 and cache.resident_bytes == 3 * one


def test_storing_a_key_again_replaces_it():
    cache = RowCache(1 << 20)
    cache.put_many([b"k" * 16], rows(0))
    cache.put_many([b"k" * 16], rows(1))
    assert len(cache) == 1 and cache.resident_bytes == RowCache.entry_bytes(row(1))
    assert cache.get_many([b"k" * 16])[0][0].tobytes() == row(1)[0].tobytes()


def test_ttl_expires_entries():
    now = [100.0]
    cache = RowCache(1 << 20, ttl_s=10.0, clock=lambda: now[0])
    cache.put_many([b"k" * 16], rows(0))
    now[0] = 109.0
    assert cache.get_many([b"k" * 16])[0] is not None
    now[0] = 110.5
    assert cache.get_many([b"k" * 16])[0] is None
    assert cache.stats.expirations == 1 and len(cache) == 0 and cache.resident_bytes == 0


def test_zero_bytes_disables_and_oversize_is_skipped():
    off = RowCache(0)
    assert off.put_many([b"k" * 16], rows(0)) == 0
    assert off.get_many([b"k" * 16]) == [None] and len(off) == 0 and not off.enabled
    tiny = RowCache(100)
    tiny.put_many([b"k" * 16], rows(0))
    assert len(tiny) == 0 and tiny.stats.too_large == 1
    with pytest.raises(ValueError, match=r"^max_bytes and ttl_s must be >= 0, got -1 and 0\.0$"):
        RowCache(-1)
    with pytest.raises(ValueError, match=r"^2 keys for 1 rows$"):
        RowCache(1 << 20).put_many([b"a", b"b"], rows(0))


@settings(max_examples=60, deadline=None)
@given(budget_entries=st.integers(0, 12),
       ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 30), min_size=1, max_size=8),
                              st.integers(1, 3)), max_size=60))
def test_byte_bound_is_never_exceeded(budget_entries, ops):
    one = RowCache.entry_bytes(row(0))
    cache = RowCache(budget_entries * one + one // 2)
    for is_put, ids, width in ops:
        keys = [i.to_bytes(16, "big") for i in ids]
        if is_put:
            # Rows of different widths and output counts, so entries differ in size.
            cache.put_many(keys, [tuple(np.ones(DIM * width, dtype=np.float32) for _ in range(width))] * len(keys))
        else:
            cache.get_many(keys)
        held = sum(RowCache.entry_bytes(v) for v, _, _ in cache._entries.values())
        assert cache.resident_bytes == held <= cache.max_bytes


def test_concurrent_use_keeps_the_bound_and_the_values():
    one = RowCache.entry_bytes(row(0))
    cache = RowCache(50 * one)
    reference = {i: row(i) for i in range(200)}
    errors = []

    def work(offset):
        try:
            for step in range(300):
                i = (offset * 31 + step * 7) % 200
                key = i.to_bytes(16, "big")
                (hit,) = cache.get_many([key])
                if hit is None:
                    cache.put_many([key], [reference[i]])
                elif hit[0].tobytes() != reference[i][0].tobytes():
                    errors.append(i)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert cache.resident_bytes <= cache.max_bytes and len(cache) <= 50
    assert cache.stats.hits + cache.stats.misses == 8 * 300
