"""``EmbeddingClient`` (blocking, thread-safe) and ``AsyncEmbeddingClient`` (asyncio) over tritonclient."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import numpy as np
from tritonclient.utils import InferenceServerException

from coalesce.core.protocol import PRIORITY_PARAMETER, REFUSED_PREFIX, TENANT_PARAMETER
from coalesce_client.errors import (
    AccessDeniedError,
    ClientError,
    InvalidInputError,
    ModelNotFoundError,
    RequestRejectedError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
)
from coalesce_client.retry import Deadline, RetryPolicy, call_with_retries, call_with_retries_async

#: Tensor names of the embedding contract (kept in step with the embedding task, ``coalesce.tasks.embedding``).
INPUT_TEXT: Final = "TEXT"
OUTPUT_EMBEDDING: Final = "EMBEDDING"
#: Triton's own refusal of a request that waited past its queue policy's timeout (``timeout_action: REJECT``).
TRITON_QUEUE_TIMEOUT: Final = "Request timeout expired"
#: Triton's refusal of a restricted API or protocol without its header (gRPC answers it as ``UNAVAILABLE``).
RESTRICTED_MARKER: Final = "is restricted, expecting header"
#: Triton's answer for a model it knows with no version loaded right now: while it unloads at shutdown (its
#: endpoints still answer during the exit timeout) or reloads. Unavailable for now, not unknown.
NO_VERSION_LOADED: Final = "has no available versions"
DEFAULT_URLS: Final = {"grpc": "localhost:8001", "http": "localhost:8000"}
PROTOCOLS: Final = ("grpc", "http")
#: Longest wait of a gRPC channel between reconnection attempts to a server that went away (gRPC's own
#: default grows to 120 s, so a restarted server would stay unreached long after it is back).
GRPC_MAX_RECONNECT_BACKOFF_MS: Final = 1000
#: Exceptions of the HTTP stacks (geventhttpclient, aiohttp) that mean the connection broke before an answer.
_CONNECTION_ERROR_NAMES: Final = frozenset({"HTTPConnectionClosed", "ClientConnectionError", "ServerDisconnectedError"})

Text = str | bytes


def _check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    return protocol


@dataclasses.dataclass(frozen=True)
class TlsOptions:
    """TLS for gRPC: the CA that signed the server's certificate, and for mutual TLS the client's own pair.

    Triton 2.51 serves gRPC over TLS (``--grpc-use-ssl``, ``--grpc-use-ssl-mutual``) and
    HTTP only in the clear, so these options need ``protocol="grpc"``.

    Attributes:
        ca_cert: PEM file of the CA (None: gRPC's default roots).
        client_cert: PEM certificate chain of this client (mutual TLS), with ``client_key``.
        client_key: PEM private key of ``client_cert``.
    """

    ca_cert: Path | str | None = None
    client_cert: Path | str | None = None
    client_key: Path | str | None = None

    def __post_init__(self) -> None:
        """Check the files exist and the client's pair comes whole."""
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together (mutual TLS): give both or neither")
        for name in ("ca_cert", "client_cert", "client_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS {name} {str(path)!r} is not a file")

    def grpc_arguments(self) -> dict[str, Any]:
        """Keyword arguments of ``tritonclient.grpc.InferenceServerClient`` (file paths)."""
        def text(path: Path | str | None) -> str | None:
            return None if path is None else str(path)

        return {"ssl": True, "root_certificates": text(self.ca_cert), "private_key": text(self.client_key),
                "certificate_chain": text(self.client_cert)}


def _grpc_channel_args() -> list[tuple[str, Any]]:
    # tritonclient's own defaults (passing channel_args replaces them), plus a short reconnection back-off.
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions

    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", GRPC_MAX_RECONNECT_BACKOFF_MS),
    ]


def _check_connection(protocol: str, tls: TlsOptions | None,
                      headers: Mapping[str, str] | None) -> tuple[TlsOptions | None, dict[str, str] | None]:
    if tls is not None and protocol != "grpc":
        raise ValueError("TLS options need protocol='grpc': Triton serves HTTP without TLS (put a proxy in front)")
    # gRPC metadata keys must be lower case; HTTP header names are case-insensitive.
    return tls, ({str(k).lower(): str(v) for k, v in headers.items()} if headers else None)


def encode_texts(texts: Sequence[Text]) -> np.ndarray:
    """Texts as the ``[N, 1]`` BYTES array the model takes (str is UTF-8 encoded; bytes are sent as they are)."""
    if isinstance(texts, str | bytes):
        raise TypeError("texts must be a sequence of strings, not a single string")
    rows = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in texts]
    array = np.empty((len(rows), 1), dtype=np.object_)
    array[:, 0] = rows
    return array


def translate_error(exc: BaseException, *, model: str, url: str, timeout_s: float | None) -> ClientError:
    """Map a tritonclient or transport exception to the client's own hierarchy."""
    if isinstance(exc, ClientError):
        return exc
    where = f"model '{model}' at {url}"
    if isinstance(exc, InferenceServerException):
        status = str(exc.status() or "")
        message = exc.message() or str(exc)
        if "DEADLINE_EXCEEDED" in status or "Deadline Exceeded" in message:
            return RequestTimeoutError(f"{where}: no answer within {timeout_s} s")
        if (RESTRICTED_MARKER in message or status in ("401", "403")
                or "PERMISSION_DENIED" in status or "UNAUTHENTICATED" in status):
            return AccessDeniedError(f"{where}: {message}")
        if NO_VERSION_LOADED in message:
            return ServerUnavailableError(f"{where}: {message}")
        if "INVALID_ARGUMENT" in status or status == "400":
            if "unknown model" in message or "is not found" in message:
                return ModelNotFoundError(f"{where}: {message}")
            return InvalidInputError(f"{where}: {message}")
        if "NOT_FOUND" in status or status == "404" or "unknown model" in message:
            return ModelNotFoundError(f"{where}: {message}")
        unavailable = "UNAVAILABLE" in status or status == "503"  # gRPC status, HTTP status code
        if REFUSED_PREFIX in message or (unavailable and TRITON_QUEUE_TIMEOUT in message):
            return RequestRejectedError(f"{where}: {message}")
        if unavailable or status == "502" or "failed to connect" in message.lower():
            return ServerUnavailableError(f"{where}: {message}")
        return ServerError(f"{where}: {message} (status {status or 'unknown'})")
    if isinstance(exc, TimeoutError | socket.timeout | asyncio.TimeoutError) or type(exc).__name__ == "Timeout":
        return RequestTimeoutError(f"{where}: no answer within {timeout_s} s")
    if isinstance(exc, ConnectionError | OSError) or any(
            kind.__name__ in _CONNECTION_ERROR_NAMES for kind in type(exc).__mro__):
        return ServerUnavailableError(f"cannot reach {url}: {type(exc).__name__}: {exc}")
    return ClientError(f"{where}: {type(exc).__name__}: {exc}")


def _check_texts(texts: Sequence[Text]) -> None:
    encode_texts(texts)  # type check before any network traffic
    if len(texts) == 0:
        raise InvalidInputError("texts is empty: pass at least one text")


def _chunks(texts: Sequence[Text], limit: int) -> list[Sequence[Text]]:
    return [texts[i:i + limit] for i in range(0, len(texts), limit)]


def _inputs(tc: Any, texts: Sequence[Text]) -> tuple[list[Any], list[Any]]:
    data = encode_texts(texts)
    infer_input = tc.InferInput(INPUT_TEXT, list(data.shape), "BYTES")
    infer_input.set_data_from_numpy(data)
    return [infer_input], [tc.InferRequestedOutput(OUTPUT_EMBEDDING)]


def _embeddings(result: Any, count: int, where: str) -> np.ndarray:
    array = result.as_numpy(OUTPUT_EMBEDDING)
    if array is None or array.shape[0] != count:
        raise ServerError(f"{where}: expected {count} embeddings, got {None if array is None else array.shape}")
    return np.asarray(array, dtype=np.float32)


class EmbeddingClient:
    """Embeds texts with a Coalesce model over gRPC or HTTP.

    Example:
        >>> with EmbeddingClient("localhost:8001") as client:  # doctest: +SKIP
        ...     vectors = client.embed(["hello", "world"])      # float32 [2, 384]

    The instance is safe to share between threads: gRPC shares one channel, and
    HTTP (gevent-based in tritonclient) gets one connection per thread.
    """

    def __init__(self, url: str | None = None, protocol: str = "grpc", model: str = "minilm", *,
                 timeout_s: float = 30.0, retry: RetryPolicy | None = None, tls: TlsOptions | None = None,
                 headers: Mapping[str, str] | None = None, max_rows_per_request: int | None = None,
                 tenant: str | None = None, priority_level: int | None = None,
                 deadline_s: float | None = None) -> None:
        """Connect lazily to ``url`` (default ``localhost:8001`` for gRPC, ``localhost:8000`` for HTTP).

        Args:
            url: ``host:port`` of the server.
            protocol: ``grpc`` or ``http``.
            model: Model name.
            timeout_s: The deadline of each call: all its attempts, and every request of a
                split list, share it; each request is given the time left.
            retry: When to retry a call the server did not answer (default ``RetryPolicy()``).
            tls: gRPC over TLS (server verified by ``ca_cert``; mutual with a client pair).
            headers: Sent with every request (HTTP headers, gRPC metadata), e.g. an
                ``authorization`` token; names are lower-cased.
            max_rows_per_request: Texts per request; longer lists are split and sent
                concurrently. Default: the model's ``max_batch_size``, asked once.
            tenant: Sent as request parameter ``tenant``: the fair-queuing class of a
                model with ``scheduling: adaptive``.
            priority_level: Sent as request parameter ``priority_level`` (1 is the highest).
            deadline_s: Sent as the request's own server-side timeout: an adaptive model
                refuses the request at once (``RequestRejectedError``) when it cannot
                answer within it.
        """
        self.protocol = _check_protocol(protocol)
        self.url = url or DEFAULT_URLS[protocol]
        self.model = model
        Deadline(timeout_s)  # validates it
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.tls, self.headers = _check_connection(protocol, tls, headers)  # headers: lower-cased names
        self._max_rows = max_rows_per_request
        self._parameters: dict[str, Any] = {}
        if tenant is not None:
            self._parameters[TENANT_PARAMETER] = tenant
        if priority_level is not None:
            self._parameters[PRIORITY_PARAMETER] = int(priority_level)
        self._server_timeout_us = int(deadline_s * 1e6) if deadline_s else None
        self._local = threading.local()
        self._grpc: Any = None
        self._lock = threading.Lock()

    @property
    def _where(self) -> str:
        return f"model '{self.model}' at {self.url}"

    def _client(self) -> Any:
        if self.protocol == "grpc":
            with self._lock:
                if self._grpc is None:
                    import tritonclient.grpc as grpcclient

                    tls = self.tls.grpc_arguments() if self.tls else {}
                    self._grpc = grpcclient.InferenceServerClient(self.url, channel_args=_grpc_channel_args(), **tls)
                return self._grpc
        client = getattr(self._local, "http", None)
        if client is None:
            import tritonclient.http as httpclient

            client = httpclient.InferenceServerClient(
                self.url, connection_timeout=self.timeout_s, network_timeout=self.timeout_s)
            self._local.http = client
        return client

    def _drop_http_client(self) -> None:
        # After a timeout or a broken connection the connection's state is unknown: start afresh.
        client = getattr(self._local, "http", None)
        if client is not None:
            self._local.http = None
            with contextlib.suppress(Exception):  # closing a broken connection may fail; it is dropped either way
                client.close()

    def _call(self, fn: Any, *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        """One request with a timeout of ``timeout_s``; its failure as a ``ClientError``."""
        if self.headers:
            kwargs["headers"] = self.headers
        try:
            if self.protocol == "grpc":
                return fn(*args, client_timeout=timeout_s, **kwargs)
            import gevent

            # The HTTP client's own timeouts bound each socket operation, not the request: bound the whole.
            with gevent.Timeout(timeout_s, TimeoutError):
                return fn(*args, **kwargs)
        except Exception as exc:
            error = translate_error(exc, model=self.model, url=self.url, timeout_s=self.timeout_s)
            if self.protocol == "http" and not isinstance(exc, InferenceServerException):
                self._drop_http_client()
            raise error from exc

    def _with_retries(self, attempt: Any, deadline: Deadline) -> Any:
        return call_with_retries(attempt, policy=self.retry, deadline=deadline, what=self._where)

    def is_ready(self) -> bool:
        """Whether the server is live and the model ready (one attempt within ``timeout_s``); False otherwise."""
        try:
            client = self._client()
            return bool(self._call(client.is_server_live, timeout_s=self.timeout_s)
                        and self._call(client.is_model_ready, self.model, timeout_s=self.timeout_s))
        except ClientError:
            return False

    def max_rows_per_request(self) -> int:
        """Texts per request: the given limit, else the model's ``max_batch_size``."""
        return self._rows_limit(Deadline(self.timeout_s))

    def model_config(self) -> dict[str, Any]:
        """The model's configuration as the server completed it (Triton's JSON form), within ``timeout_s``.

        Raises:
            ClientError: A subclass saying what went wrong, as for ``embed``.
        """
        return self._model_config(Deadline(self.timeout_s))

    def _model_config(self, deadline: Deadline) -> dict[str, Any]:
        def attempt(timeout_s: float) -> dict[str, Any]:
            client = self._client()
            if self.protocol == "grpc":
                return dict(self._call(client.get_model_config, self.model, as_json=True,
                                       timeout_s=timeout_s)["config"])
            return dict(self._call(client.get_model_config, self.model, timeout_s=timeout_s))

        return dict(self._with_retries(attempt, deadline))

    def _rows_limit(self, deadline: Deadline) -> int:
        if self._max_rows is None:
            config = self._model_config(deadline)
            self._max_rows = max(int(config.get("max_batch_size", 0)), 1)
        return self._max_rows

    def infer(self, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """One request of named tensors to the model, whatever its task, with this client's deadline and retries.

        Arrays are sent as they are (an object array of bytes as BYTES, the others by their
        numpy type); no list is split. Returns each of ``outputs`` by name.

        Raises:
            ClientError: A subclass saying what went wrong, as for ``embed``.
        """
        from tritonclient.utils import np_to_triton_dtype

        if self.protocol == "grpc":
            import tritonclient.grpc as tc
        else:
            import tritonclient.http as tc
        items = []
        for name, array in inputs.items():
            item = tc.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            item.set_data_from_numpy(array)
            items.append(item)
        wanted = [tc.InferRequestedOutput(name) for name in outputs]
        kwargs: dict[str, Any] = {}
        if self._parameters:
            kwargs["parameters"] = self._parameters
        if self._server_timeout_us:
            kwargs["timeout"] = self._server_timeout_us

        def attempt(timeout_s: float) -> dict[str, np.ndarray]:
            result = self._call(self._client().infer, self.model, items, outputs=wanted, timeout_s=timeout_s,
                                **kwargs)
            answer = {name: result.as_numpy(name) for name in outputs}
            missing = [name for name, array in answer.items() if array is None]
            if missing:
                raise ServerError(f"{self._where}: the answer lacks output(s) {', '.join(missing)}")
            return answer

        return dict(self._with_retries(attempt, Deadline(self.timeout_s)))

    def _infer_once(self, texts: Sequence[Text], timeout_s: float) -> np.ndarray:
        client = self._client()
        if self.protocol == "grpc":
            import tritonclient.grpc as tc
        else:
            import tritonclient.http as tc
        inputs, outputs = _inputs(tc, texts)
        kwargs: dict[str, Any] = {}
        if self._parameters:
            kwargs["parameters"] = self._parameters
        if self._server_timeout_us:
            kwargs["timeout"] = self._server_timeout_us
        result = self._call(client.infer, self.model, inputs, outputs=outputs, timeout_s=timeout_s, **kwargs)
        return _embeddings(result, len(texts), self._where)

    def _embed(self, texts: Sequence[Text], deadline: Deadline) -> np.ndarray:
        _check_texts(texts)
        # A single text never needs the model's limit, so it costs no config lookup.
        if len(texts) == 1 or len(texts) <= self._rows_limit(deadline):
            return self._with_retries(lambda timeout_s: self._infer_once(texts, timeout_s), deadline)
        chunks = _chunks(texts, self._rows_limit(deadline))
        with ThreadPoolExecutor(max_workers=min(8, len(chunks)), thread_name_prefix="coalesce-client") as pool:
            return np.concatenate(list(pool.map(lambda chunk: self._embed(chunk, deadline), chunks)))

    def embed(self, texts: Sequence[Text]) -> np.ndarray:
        """Embed ``texts``; returns float32 ``[len(texts), dim]``, rows in input order.

        Raises:
            InvalidInputError: The server rejected the input (e.g. not UTF-8).
            RequestTimeoutError: No answer within ``timeout_s``.
            ServerUnavailableError: The server is unreachable or not serving (after the retries).
            RequestRejectedError: An adaptive model refused the request (after the retries).
            ModelNotFoundError: The model is not loaded.
            ServerError: Anything else the server reported.
        """
        return self._embed(texts, Deadline(self.timeout_s))

    def embed_many(self, batches: Iterable[Sequence[Text]], max_in_flight: int = 8) -> list[np.ndarray]:
        """Embed many lists of texts as concurrent requests; one array per list, in order.

        Triton's dynamic batcher sees up to ``max_in_flight`` requests at once and the
        backend coalesces their rows into shared forward passes. The whole call has one
        deadline, ``timeout_s``.
        """
        items = list(batches)
        if not items:
            return []
        deadline = Deadline(self.timeout_s)
        workers = max(1, min(max_in_flight, len(items)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coalesce-client") as pool:
            return list(pool.map(lambda texts: self._embed(texts, deadline), items))

    def close(self) -> None:
        """Close the connections of this thread (and the shared gRPC channel)."""
        with self._lock:
            if self._grpc is not None:
                self._grpc.close()
                self._grpc = None
        http = getattr(self._local, "http", None)
        if http is not None:
            http.close()
            self._local.http = None

    def __enter__(self) -> EmbeddingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEmbeddingClient:
    """The asyncio variant, over ``tritonclient.grpc.aio`` / ``tritonclient.http.aio``."""

    def __init__(self, url: str | None = None, protocol: str = "grpc", model: str = "minilm", *,
                 timeout_s: float = 30.0, retry: RetryPolicy | None = None, tls: TlsOptions | None = None,
                 headers: Mapping[str, str] | None = None, max_rows_per_request: int | None = None) -> None:
        """Connect lazily; arguments as for ``EmbeddingClient``."""
        self.protocol = _check_protocol(protocol)
        self.url = url or DEFAULT_URLS[protocol]
        self.model = model
        Deadline(timeout_s)  # validates it
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.tls, self.headers = _check_connection(protocol, tls, headers)  # headers: lower-cased names
        self._max_rows = max_rows_per_request
        self._client: Any = None

    @property
    def _where(self) -> str:
        return f"model '{self.model}' at {self.url}"

    def _get(self) -> Any:
        if self._client is None:
            if self.protocol == "grpc":
                import tritonclient.grpc.aio as aio_grpc

                tls = self.tls.grpc_arguments() if self.tls else {}
                self._client = aio_grpc.InferenceServerClient(self.url, channel_args=_grpc_channel_args(), **tls)
            else:
                import tritonclient.http.aio as aio_http

                self._client = aio_http.InferenceServerClient(self.url, conn_timeout=self.timeout_s)
        return self._client

    async def _call(self, fn: Any, *args: Any, timeout_s: float, **kwargs: Any) -> Any:
        if self.headers:
            kwargs["headers"] = self.headers
        try:
            if self.protocol == "grpc":
                return await fn(*args, client_timeout=timeout_s, **kwargs)
            return await asyncio.wait_for(fn(*args, **kwargs), timeout=timeout_s)
        except Exception as exc:
            raise translate_error(exc, model=self.model, url=self.url, timeout_s=self.timeout_s) from exc

    async def _with_retries(self, attempt: Any, deadline: Deadline) -> Any:
        return await call_with_retries_async(attempt, policy=self.retry, deadline=deadline, what=self._where)

    async def _rows_limit(self, deadline: Deadline) -> int:
        if self._max_rows is None:
            async def attempt(timeout_s: float) -> dict[str, Any]:
                client = self._get()
                if self.protocol == "grpc":
                    answer = await self._call(client.get_model_config, self.model, as_json=True, timeout_s=timeout_s)
                    return dict(answer["config"])
                return dict(await self._call(client.get_model_config, self.model, timeout_s=timeout_s))

            config = await self._with_retries(attempt, deadline)
            self._max_rows = max(int(config.get("max_batch_size", 0)), 1)
        return self._max_rows

    async def _infer_once(self, texts: Sequence[Text], timeout_s: float) -> np.ndarray:
        if self.protocol == "grpc":
            import tritonclient.grpc as tc
        else:
            import tritonclient.http as tc
        inputs, outputs = _inputs(tc, texts)
        result = await self._call(self._get().infer, self.model, inputs, outputs=outputs, timeout_s=timeout_s)
        return _embeddings(result, len(texts), self._where)

    async def _embed(self, texts: Sequence[Text], deadline: Deadline) -> np.ndarray:
        _check_texts(texts)
        if len(texts) == 1 or len(texts) <= await self._rows_limit(deadline):
            return await self._with_retries(lambda timeout_s: self._infer_once(texts, timeout_s), deadline)
        chunks = _chunks(texts, await self._rows_limit(deadline))
        return np.concatenate(await asyncio.gather(*(self._embed(chunk, deadline) for chunk in chunks)))

    async def embed(self, texts: Sequence[Text]) -> np.ndarray:
        """Embed ``texts``; float32 ``[len(texts), dim]``; long lists are split, all within ``timeout_s``.

        Raises:
            ClientError: A subclass saying what went wrong, as for ``EmbeddingClient.embed``.
        """
        return await self._embed(texts, Deadline(self.timeout_s))

    async def embed_many(self, batches: Iterable[Sequence[Text]], max_in_flight: int = 8) -> list[np.ndarray]:
        """Embed many lists of texts with at most ``max_in_flight`` requests outstanding, within one deadline."""
        gate = asyncio.Semaphore(max_in_flight)
        deadline = Deadline(self.timeout_s)

        async def one(texts: Sequence[Text]) -> np.ndarray:
            async with gate:
                return await self._embed(texts, deadline)

        return list(await asyncio.gather(*(one(b) for b in batches)))

    async def close(self) -> None:
        """Close the connection."""
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def __aenter__(self) -> AsyncEmbeddingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
