import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coalesce.cache import RowCache, file_digest, output_fingerprint, row_key

DIM = 384
BASE = {"model": "minilm", "version": "1", "weights_sha256": "ab" * 32, "tokenizer_sha256": "cd" * 32,
        "max_sequence_length": 256, "pooling": "mean", "normalize": True, "runtime": "onnxruntime",
        "precision": "fp32"}


def vec(seed, n=1):
    return np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)


def test_keys_are_stable_and_depend_on_text():
    fp = output_fingerprint(BASE)
    assert output_fingerprint(dict(reversed(list(BASE.items())))) == fp  # order of fields does not matter
    assert row_key(fp, "hello") == row_key(fp, "hello")
    assert row_key(fp, "hello") != row_key(fp, "hello ")
    assert len(row_key(fp, "")) == 16
    # Pinned, so an accidental change of the key scheme (which would strand a shared cache) fails here.
    assert output_fingerprint({"model": "m"}).hex()[:16] == "548f58d1c36c715b"
    assert row_key(b"\x00" * 32, "hello").hex() == "d63cf02419882a93dc85e3836b325fc4"


@pytest.mark.parametrize(("field", "other"), [
    ("model", "other"), ("version", "2"), ("weights_sha256", "ef" * 32), ("tokenizer_sha256", "01" * 32),
    ("max_sequence_length", 128), ("pooling", "cls"), ("normalize", False), ("runtime", "tensorrt"),
    ("precision", "fp16"),
])
def test_every_output_affecting_field_changes_the_key(field, other):
    changed = {**BASE, field: other}
    assert row_key(output_fingerprint(changed), "same text") != row_key(output_fingerprint(BASE), "same text")


def test_file_digest(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"x" * (3 << 20) + b"tail")
    first = file_digest(path, chunk_bytes=1 << 20)
    assert first == file_digest(path) and len(first) == 64
    path.write_bytes(b"x" * (3 << 20) + b"tale")
    assert file_digest(path) != first


def test_hits_are_bit_identical_and_read_only():
    cache = RowCache(1 << 20)
    keys = [b"a" * 16, b"b" * 16]
    vectors = vec(0, 2)
    cache.put_many(keys, vectors)
    vectors[0] += 1.0  # the caller's array changing later must not reach the cache
    got = cache.get_many([keys[1], b"c" * 16, keys[0]])
    assert got[1] is None
    assert got[0].tobytes() == vec(0, 2)[1].tobytes() and got[2].tobytes() == vec(0, 2)[0].tobytes()
    with pytest.raises(ValueError):
        got[0][0] = 0.0
    assert (cache.stats.hits, cache.stats.misses) == (2, 1)


def test_least_recently_used_is_evicted_first():
    one = RowCache.entry_bytes(vec(0)[0])
    cache = RowCache(3 * one)
    for i in range(3):
        cache.put_many([bytes([i]) * 16], vec(i))
    cache.get_many([bytes([0]) * 16])  # 0 becomes the most recent; 1 is now the oldest
    cache.put_many([bytes([3]) * 16], vec(3))
    assert [v is not None for v in cache.get_many([bytes([i]) * 16 for i in range(4)])] == [True, False, True, True]
    assert cache.stats.evictions == 1 and cache.resident_bytes == 3 * one


def test_ttl_expires_entries():
    now = [100.0]
    cache = RowCache(1 << 20, ttl_s=10.0, clock=lambda: now[0])
    cache.put_many([b"k" * 16], vec(0))
    now[0] = 109.0
    assert cache.get_many([b"k" * 16])[0] is not None
    now[0] = 110.5
    assert cache.get_many([b"k" * 16])[0] is None
    assert cache.stats.expirations == 1 and len(cache) == 0 and cache.resident_bytes == 0


def test_zero_bytes_disables_and_oversize_is_skipped():
    off = RowCache(0)
    off.put_many([b"k" * 16], vec(0))
    assert off.get_many([b"k" * 16]) == [None] and len(off) == 0 and not off.enabled
    tiny = RowCache(100)
    tiny.put_many([b"k" * 16], vec(0))
    assert len(tiny) == 0 and tiny.stats.too_large == 1
    with pytest.raises(ValueError, match="max_bytes and ttl_s must be >= 0"):
        RowCache(-1)
    with pytest.raises(ValueError, match="2 keys for 1 vectors"):
        RowCache(1 << 20).put_many([b"a", b"b"], vec(0))


@settings(max_examples=60, deadline=None)
@given(budget_entries=st.integers(0, 12),
       ops=st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 30), min_size=1, max_size=8),
                              st.integers(1, 3)), max_size=60))
def test_byte_bound_is_never_exceeded(budget_entries, ops):
    one = RowCache.entry_bytes(vec(0)[0])
    cache = RowCache(budget_entries * one + one // 2)
    for is_put, ids, width in ops:
        keys = [i.to_bytes(16, "big") for i in ids]
        if is_put:
            # Vectors of different widths, so entries differ in size.
            cache.put_many(keys, np.ones((len(keys), DIM * width), dtype=np.float32))
        else:
            cache.get_many(keys)
        held = sum(RowCache.entry_bytes(v) for v, _, _ in cache._entries.values())
        assert cache.resident_bytes == held <= cache.max_bytes


def test_concurrent_use_keeps_the_bound_and_the_values():
    one = RowCache.entry_bytes(vec(0)[0])
    cache = RowCache(50 * one)
    reference = {i: vec(i)[0] for i in range(200)}
    errors = []

    def work(offset):
        try:
            for step in range(300):
                i = (offset * 31 + step * 7) % 200
                key = i.to_bytes(16, "big")
                (hit,) = cache.get_many([key])
                if hit is None:
                    cache.put_many([key], reference[i][None, :])
                elif hit.tobytes() != reference[i].tobytes():
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
