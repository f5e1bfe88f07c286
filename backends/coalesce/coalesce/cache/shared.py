"""The shared row-cache tier: Redis, looked up once per batch, written off the request path.

Several model instances and servers point at one Redis and share the rows any of them
computed, so a server that starts (or a model that reloads) finds the rows its peers
already computed. Keys are ``coalesce.cache.keys.row_key`` digests (which already cover
the model, version, files and every output-affecting setting) under a prefix; a value is
the raw bytes of one row's outputs, one after the other in the task's output order,
followed by a MAC: a keyed BLAKE2b over the full Redis key and those bytes.

Nothing unverified from Redis is ever an answer. A value is used only if its MAC is
valid for the key it was read under (so a value copied under another key, another row's
outputs, is refused), its size is exactly what the row's outputs take, every float is
finite, and every vector of an output the task L2-normalises (``Task.unit_norm_outputs``)
has norm 1 within ``UNIT_NORM_TOLERANCE``. A reply of the wrong type or length, or a
value failing any check, is a miss counted as ``corrupt``; the row is computed and its
fresh value overwrites the bad one. The MAC key is derived from a secret the operator
sets (``coalesce.cache.secrets``), else from the model's output fingerprint: then
stale, truncated and copied values are still refused, but someone who can write to Redis
and knows the model's files could forge a value; set a secret where that matters.

The Redis password and the CA of a ``rediss://`` (TLS) server come from files or the
environment, never from ``redis_url``, which Triton serves back in the model's config.

The tier fails open. Every Redis call is bounded by a timeout; an error (Redis down,
slow, refusing the password, or a reply the client cannot parse) is
counted, logged at most once per interval, and makes the
tier stand aside for ``retry_s``, during which lookups miss and writes are dropped
without touching the network. After that the next call tries Redis again, so the tier
comes back by itself when Redis does. A request never fails because of the cache.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from coalesce.cache.memory import RowOutputs
from coalesce.core.errors import ConfigError
from coalesce.observability.log import Logger

if TYPE_CHECKING:
    from coalesce.observability.metrics import PipelineMetrics

#: How one row's value is laid out: each output's dtype and shape, in order.
RowLayout = tuple[tuple[np.dtype[Any], tuple[int, ...]], ...]

#: Seconds between two log lines about Redis errors; the errors in between are counted, not logged.
ERROR_LOG_INTERVAL_S: Final = 30.0
#: Write batches queued for the writer thread; past this, new writes are dropped (and counted).
MAX_PENDING_WRITE_BATCHES: Final = 256
#: Bytes of the MAC that ends every stored value.
MAC_BYTES: Final = 16
#: Most a stored vector's L2 norm may differ from 1 where the task normalises the output (float32 rounding is ~1e-6).
UNIT_NORM_TOLERANCE: Final = 1e-3
_MAC_PERSON: Final = b"coalesce-mac-v1"


def mac_key(secret: bytes) -> bytes:
    """The 32-byte MAC key derived from ``secret`` (an operator's secret, or the output fingerprint)."""
    return hashlib.blake2b(secret, digest_size=32, person=_MAC_PERSON).digest()


def sign(key: bytes, redis_key: bytes, payload: bytes) -> bytes:
    """``payload`` followed by its MAC under ``key``, bound to the full ``redis_key`` it is stored under."""
    return payload + _mac(key, redis_key, payload)


def _mac(key: bytes, redis_key: bytes, payload: bytes | memoryview) -> bytes:
    digest = hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=_MAC_PERSON)
    digest.update(len(redis_key).to_bytes(4, "big"))  # the key's length first: key/payload splits cannot collide
    digest.update(redis_key)
    digest.update(payload)
    return digest.digest()


def redacted(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class RedisTier:
    """A Redis-backed tier of row outputs; thread-safe, fail-open.

    ``get_many`` costs one round trip (``MGET``) per batch; ``put_many`` hands the rows
    to a writer thread that stores everything queued in one round trip (``MSET``, or a
    pipeline of ``SET ... PX`` with a time to live).
    """

    def __init__(self, url: str, *, timeout_s: float, retry_s: float, mac_secret: bytes, ttl_s: float = 0.0,
                 key_prefix: str = "coalesce:", password: str | None = None, ca_file: str | None = None,
                 logger: Logger | None = None, metrics: PipelineMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic, log_interval_s: float = ERROR_LOG_INTERVAL_S) -> None:
        """Connect lazily to ``url``; a Redis that is down at start is reported, not fatal.

        ``mac_secret`` signs and verifies every value (``mac_key``); ``password`` is sent with
        ``AUTH``; ``ca_file`` verifies a ``rediss://`` server (the system's CAs without it).

        Raises:
            ConfigError: If the ``redis`` package is missing or ``url`` cannot be parsed.
        """
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ConfigError("parameter 'redis_url' is set but the 'redis' package is not installed "
                              "(pip install 'coalesce[redis]')") from None
        self.url = redacted(url)
        self.retry_s = retry_s
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self._prefix = key_prefix.encode("utf-8")
        self._logger = logger or Logger("shared-cache")
        self._metrics = metrics
        self._clock = clock
        self._log_interval_s = log_interval_s
        self._errors = redis.RedisError
        self._mac_key = mac_key(mac_secret)
        self._last_corrupt_log = float("-inf")
        self._unlogged_corrupt = 0
        extra: dict[str, Any] = {"password": password} if password else {}
        if ca_file and url.startswith("rediss://"):
            extra["ssl_ca_certs"] = ca_file
        try:
            # No client-side retries: one bounded attempt, then the tier stands aside for retry_s.
            self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                                retry=Retry(NoBackoff(), 0), health_check_interval=0, **extra)
        except ValueError as exc:
            raise ConfigError(f"parameter 'redis_url' has bad value '{self.url}': {exc}") from None
        self._lock = threading.Lock()
        self._down_until = float("-inf")
        self._failing = False
        self._last_log = float("-inf")
        self._unlogged_errors = 0
        self._pending: deque[tuple[list[bytes], list[bytes]] | None] = deque()
        self._pending_cond = threading.Condition()
        self._busy = 0  # batches taken by the writer and not yet finished
        self._writer = threading.Thread(target=self._write_loop, name="coalesce-redis-writer", daemon=True)
        self._writer.start()
        self._call("connect", self._client.ping)

    # -- public ------------------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """False while the tier stands aside after an error."""
        return self._clock() >= self._down_until

    def get_many(self, keys: Sequence[bytes], layouts: Sequence[RowLayout],
                 unit_norm: Sequence[bool] = ()) -> list[RowOutputs | None]:
        """The stored outputs of each key (read-only arrays laid out as ``layouts[i]``), or None.

        ``unit_norm[j]`` says output ``j`` is L2-normalised by the task (its vectors must have
        norm 1). All None while Redis is unavailable; a reply or value that fails a check
        (see the module's notes) is counted as corrupt and missed.
        """
        if len(keys) != len(layouts):
            raise ValueError(f"{len(keys)} keys for {len(layouts)} layouts")
        if not keys:
            return []
        if not self.available:
            self._count("shared_cache_skipped_rows", len(keys))
            return [None] * len(keys)
        start = time.perf_counter()
        redis_keys = [self._prefix + k for k in keys]
        values = self._call("get", self._client.mget, redis_keys)
        if self._metrics is not None:
            self._metrics.shared_cache_lookup_seconds.observe(time.perf_counter() - start)
        if values is None:
            return [None] * len(keys)
        found: list[RowOutputs | None] = [None] * len(keys)
        corrupt: dict[str, int] = {}
        if not isinstance(values, list) or len(values) != len(keys):
            # Not MGET's answer to our keys (a proxy or another client's reply): nothing in it can be trusted.
            corrupt["reply"] = len(keys)
        else:
            for i, value in enumerate(values):
                if value is None:
                    continue
                row, why = self._verify(redis_keys[i], value, layouts[i], unit_norm)
                if why:
                    corrupt[why] = corrupt.get(why, 0) + 1  # a miss, never a wrong answer
                found[i] = row
        hits = sum(v is not None for v in found)
        self._count("shared_cache_hits", hits)
        self._count("shared_cache_misses", len(keys) - hits)
        if corrupt:
            self._corrupt(corrupt)
        return found

    def put_many(self, keys: Sequence[bytes], rows: Sequence[RowOutputs]) -> None:
        """Queue ``rows[i]`` under ``keys[i]`` for the writer thread; never blocks on Redis."""
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys for {len(rows)} rows")
        if not keys:
            return
        if not self.available:
            self._count("shared_cache_skipped_rows", len(keys))
            return
        batch = [b"".join(np.ascontiguousarray(a).tobytes() for a in row) for row in rows]  # copies
        with self._pending_cond:
            if len(self._pending) >= MAX_PENDING_WRITE_BATCHES:
                self._count("shared_cache_dropped_rows", len(keys))
                return
            self._pending.append((list(keys), batch))
            self._pending_cond.notify_all()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued write is done (stored or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._pending_cond:
            while self._pending or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._pending_cond.wait(remaining)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Finish queued writes (up to ``timeout_s``), stop the writer and close the connections."""
        self.flush(timeout_s)
        with self._pending_cond:
            self._pending.append(None)
            self._pending_cond.notify_all()
        self._writer.join(timeout_s)
        self._client.close()

    # -- internals ---------------------------------------------------------------------------------------

    def _verify(self, redis_key: bytes, value: object, layout: RowLayout,
                unit_norm: Sequence[bool]) -> tuple[RowOutputs | None, str]:
        """The row stored in ``value``, or None and why it is refused."""
        if not isinstance(value, bytes):
            return None, "type"
        if len(value) != layout_bytes(layout) + MAC_BYTES:
            return None, "size"
        payload = memoryview(value)[:-MAC_BYTES]
        if not hmac.compare_digest(_mac(self._mac_key, redis_key, payload), value[-MAC_BYTES:]):
            return None, "mac"
        row = _decode(payload, layout)
        if row is None:
            return None, "size"
        for j, array in enumerate(row):
            if array.dtype.kind in "fc" and not np.isfinite(array).all():
                return None, "non-finite"
            if j < len(unit_norm) and unit_norm[j] and array.ndim and array.shape[-1]:
                norms = np.linalg.norm(array.reshape(-1, array.shape[-1]).astype(np.float64), axis=1)
                if not (np.abs(norms - 1.0) <= UNIT_NORM_TOLERANCE).all():
                    return None, "norm"
        return row, ""

    def _corrupt(self, reasons: dict[str, int]) -> None:
        """Count refused values and log them at most once per interval (they are misses, not errors of Redis)."""
        total = sum(reasons.values())
        self._count_error("corrupt", total)
        now = self._clock()
        with self._lock:
            self._unlogged_corrupt += total
            due = now - self._last_corrupt_log >= self._log_interval_s
            if due:
                count, self._unlogged_corrupt, self._last_corrupt_log = self._unlogged_corrupt, 0, now
        if due:
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
            self._logger.warning(
                f"shared cache {self.url}: refused {count} value(s) that failed verification since the last "
                f"message (now: {why}); computed those rows instead and overwrite them")

    def _write_loop(self) -> None:
        while True:
            with self._pending_cond:
                while not self._pending:
                    self._pending_cond.wait()
                # Everything queued so far goes in one round trip: fewer wake-ups and syscalls under load.
                items = []
                while self._pending and self._pending[0] is not None:
                    items.append(self._pending.popleft())
                stop = not items
                self._busy += len(items)
            if stop:
                return
            rows = [(key, row) for item in items if item is not None for key, row in zip(*item, strict=True)]
            try:
                if self.available:
                    self._call("set", self._store, rows)
                else:
                    self._count("shared_cache_skipped_rows", len(rows))
            finally:
                with self._pending_cond:
                    self._busy -= len(items)
                    self._pending_cond.notify_all()

    def _store(self, rows: list[tuple[bytes, bytes]]) -> Any:
        signed = [(self._prefix + key, sign(self._mac_key, self._prefix + key, value)) for key, value in rows]
        if self.ttl_ms is None:
            return self._client.mset(dict(signed))
        pipe = self._client.pipeline(transaction=False)
        for key, value in signed:
            pipe.set(key, value, px=self.ttl_ms)
        return pipe.execute()

    def _call(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, or None after counting and reporting a Redis error."""
        try:
            result = fn(*args)
        except (self._errors, OSError) as exc:
            self._failed(op, exc)
            return None
        self._set_up(True)
        return result

    def _failed(self, op: str, exc: BaseException) -> None:
        now = self._clock()
        with self._lock:
            self._down_until = now + self.retry_s
            self._failing = True
            self._unlogged_errors += 1
            due = now - self._last_log >= self._log_interval_s
            if due:
                count, self._unlogged_errors, self._last_log = self._unlogged_errors, 0, now
        self._count_error(op, 1)
        self._set_gauge(0.0)
        if due:
            self._logger.warning(
                f"shared cache {self.url}: {op} failed ({type(exc).__name__}: {exc}); serving without it, "
                f"next try in {self.retry_s:g} s ({count} error(s) since the last message)")

    def _set_up(self, up: bool) -> None:
        if not up:
            return
        with self._lock:
            recovered, self._failing = self._failing, False
        self._set_gauge(1.0)
        if recovered:
            self._logger.info(f"shared cache {self.url}: reachable again")

    def _count(self, name: str, value: int) -> None:
        if self._metrics is not None and value:
            getattr(self._metrics, name).increment(value)

    def _count_error(self, op: str, value: int) -> None:
        if self._metrics is not None:
            self._metrics.shared_cache_errors[op].increment(value)

    def _set_gauge(self, value: float) -> None:
        if self._metrics is not None:
            self._metrics.shared_cache_up.set(value)


def layout_bytes(layout: RowLayout) -> int:
    """Bytes a row of ``layout`` takes."""
    return sum(dtype.itemsize * int(np.prod(shape, dtype=np.int64)) for dtype, shape in layout)


def _decode(value: bytes | memoryview, layout: RowLayout) -> RowOutputs | None:
    """The arrays of one stored row, or None when its size is not the layout's."""
    if len(value) != layout_bytes(layout):
        return None
    out = []
    offset = 0
    for dtype, shape in layout:
        count = int(np.prod(shape, dtype=np.int64))
        out.append(np.frombuffer(value, dtype=dtype, count=count, offset=offset).reshape(shape))
        offset += count * dtype.itemsize
    return tuple(out)
