"""``EmbeddingClient`` (blocking, thread-safe) and ``AsyncEmbeddingClient`` (asyncio) over tritonclient."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import numpy as np
from tritonclient.utils import InferenceServerException

from coalesce_client.errors import (
    ClientError,
    InvalidInputError,
    ModelNotFoundError,
    RequestRejectedError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
)

#: Tensor names of the embedding contract (kept in step with the embedding task, ``coalesce.tasks.embedding``).
INPUT_TEXT: Final = "TEXT"
OUTPUT_EMBEDDING: Final = "EMBEDDING"
#: How an adaptive model's refusals begin (``coalesce.scheduling.driver.REFUSED_PREFIX``; the client
#: does not import the backend).
REFUSED_MARKER: Final = "request refused: "
#: Triton's own refusal of a request that waited past its queue policy's timeout (``timeout_action: REJECT``).
TRITON_QUEUE_TIMEOUT: Final = "Request timeout expired"
DEFAULT_URLS: Final = {"grpc": "localhost:8001", "http": "localhost:8000"}
PROTOCOLS: Final = ("grpc", "http")

Text = str | bytes


def _check_protocol(protocol: str) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    return protocol


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
    if isinstance(exc, InferenceServerException):
        status = str(exc.status() or "")
        message = exc.message() or str(exc)
        where = f"model '{model}' at {url}"
        if "DEADLINE_EXCEEDED" in status or "Deadline Exceeded" in message:
            return RequestTimeoutError(f"{where}: no answer within {timeout_s} s")
        if "INVALID_ARGUMENT" in status or status == "400":
            if "unknown model" in message or "is not found" in message:
                return ModelNotFoundError(f"{where}: {message}")
            return InvalidInputError(f"{where}: {message}")
        if "NOT_FOUND" in status or status == "404" or "unknown model" in message:
            return ModelNotFoundError(f"{where}: {message}")
        unavailable = "UNAVAILABLE" in status or status == "503"  # gRPC status, HTTP status code
        if REFUSED_MARKER in message or (unavailable and TRITON_QUEUE_TIMEOUT in message):
            return RequestRejectedError(f"{where}: {message}")
        if unavailable or status == "502" or "failed to connect" in message.lower():
            return ServerUnavailableError(f"{where}: {message}")
        return ServerError(f"{where}: {message} (status {status or 'unknown'})")
    if isinstance(exc, TimeoutError | socket.timeout | asyncio.TimeoutError) or type(exc).__name__ == "Timeout":
        return RequestTimeoutError(f"model '{model}' at {url}: no answer within {timeout_s} s")
    if isinstance(exc, ConnectionError | OSError):
        return ServerUnavailableError(f"cannot reach {url}: {exc}")
    return ClientError(f"model '{model}' at {url}: {type(exc).__name__}: {exc}")


class EmbeddingClient:
    """Embeds texts with a Coalesce model over gRPC or HTTP.

    Example:
        >>> with EmbeddingClient("localhost:8001") as client:  # doctest: +SKIP
        ...     vectors = client.embed(["hello", "world"])      # float32 [2, 384]

    The instance is safe to share between threads: gRPC shares one channel, and
    HTTP (gevent-based in tritonclient) gets one connection per thread.
    """

    def __init__(self, url: str | None = None, protocol: str = "grpc", model: str = "minilm", *,
                 timeout_s: float = 30.0, max_rows_per_request: int | None = None, tenant: str | None = None,
                 priority_level: int | None = None, deadline_s: float | None = None) -> None:
        """Connect lazily to ``url`` (default ``localhost:8001`` for gRPC, ``localhost:8000`` for HTTP).

        Args:
            url: ``host:port`` of the server.
            protocol: ``grpc`` or ``http``.
            model: Model name.
            timeout_s: Limit of each call, connection included.
            max_rows_per_request: Texts per request; longer lists are split and sent
                concurrently. Default: the model's ``max_batch_size``, asked once.
            tenant: Sent as request parameter ``tenant``: the fair-queuing class of a
                model with ``scheduling: adaptive``.
            priority_level: Sent as request parameter ``priority_level`` (1 is the highest).
            deadline_s: Sent as the request's own server-side timeout: an adaptive model
                refuses the request at once (``ServerUnavailableError``) when it cannot
                answer within it.
        """
        self.protocol = _check_protocol(protocol)
        self.url = url or DEFAULT_URLS[protocol]
        self.model = model
        self.timeout_s = timeout_s
        self._max_rows = max_rows_per_request
        self._parameters: dict[str, Any] = {}
        if tenant is not None:
            self._parameters["tenant"] = tenant
        if priority_level is not None:
            self._parameters["priority_level"] = int(priority_level)
        self._server_timeout_us = int(deadline_s * 1e6) if deadline_s else None
        self._local = threading.local()
        self._grpc: Any = None
        self._lock = threading.Lock()

    def _client(self) -> Any:
        if self.protocol == "grpc":
            with self._lock:
                if self._grpc is None:
                    import tritonclient.grpc as grpcclient

                    self._grpc = grpcclient.InferenceServerClient(self.url)
                return self._grpc
        client = getattr(self._local, "http", None)
        if client is None:
            import tritonclient.http as httpclient

            client = httpclient.InferenceServerClient(
                self.url, connection_timeout=self.timeout_s, network_timeout=self.timeout_s)
            self._local.http = client
        return client

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise translate_error(exc, model=self.model, url=self.url, timeout_s=self.timeout_s) from exc

    def is_ready(self) -> bool:
        """Whether the server is live and the model ready; False when unreachable."""
        try:
            client = self._client()
            kwargs = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
            return bool(client.is_server_live(**kwargs) and client.is_model_ready(self.model, **kwargs))
        except Exception:
            return False

    def max_rows_per_request(self) -> int:
        """Texts per request: the given limit, else the model's ``max_batch_size``."""
        if self._max_rows is None:
            client = self._client()
            if self.protocol == "grpc":
                config = self._call(client.get_model_config, self.model, as_json=True,
                                    client_timeout=self.timeout_s)["config"]
            else:
                config = self._call(client.get_model_config, self.model)
            self._max_rows = max(int(config.get("max_batch_size", 0)), 1)
        return self._max_rows

    def _infer_one(self, texts: Sequence[Text]) -> np.ndarray:
        client = self._client()
        if self.protocol == "grpc":
            import tritonclient.grpc as tc
        else:
            import tritonclient.http as tc
        data = encode_texts(texts)
        infer_input = tc.InferInput(INPUT_TEXT, list(data.shape), "BYTES")
        infer_input.set_data_from_numpy(data)
        outputs = [tc.InferRequestedOutput(OUTPUT_EMBEDDING)]
        kwargs: dict[str, Any] = {"client_timeout": self.timeout_s} if self.protocol == "grpc" else {}
        if self._parameters:
            kwargs["parameters"] = self._parameters
        if self._server_timeout_us:
            kwargs["timeout"] = self._server_timeout_us
        result = self._call(client.infer, self.model, [infer_input], outputs=outputs, **kwargs)
        array = result.as_numpy(OUTPUT_EMBEDDING)
        if array is None or array.shape[0] != len(texts):
            raise ServerError(f"model '{self.model}' at {self.url}: expected {len(texts)} embeddings, "
                              f"got {None if array is None else array.shape}")
        return np.asarray(array, dtype=np.float32)

    def embed(self, texts: Sequence[Text]) -> np.ndarray:
        """Embed ``texts``; returns float32 ``[len(texts), dim]``, rows in input order.

        Raises:
            InvalidInputError: The server rejected the input (e.g. not UTF-8).
            RequestTimeoutError: No answer within ``timeout_s``.
            ServerUnavailableError: The server is unreachable or not serving.
            ModelNotFoundError: The model is not loaded.
            ServerError: Anything else the server reported.
        """
        encode_texts(texts)  # type check before any network traffic
        if len(texts) == 0:
            raise InvalidInputError("texts is empty: pass at least one text")
        # A single text never needs the model's limit, so it costs no config lookup.
        if len(texts) == 1 or len(texts) <= self.max_rows_per_request():
            return self._infer_one(texts)
        limit = self.max_rows_per_request()
        chunks = [texts[i:i + limit] for i in range(0, len(texts), limit)]
        return np.concatenate(self.embed_many(chunks))

    def embed_many(self, batches: Iterable[Sequence[Text]], max_in_flight: int = 8) -> list[np.ndarray]:
        """Embed many lists of texts as concurrent requests; one array per list, in order.

        Triton's dynamic batcher sees up to ``max_in_flight`` requests at once and the
        backend coalesces their rows into shared forward passes.
        """
        items = list(batches)
        if not items:
            return []
        workers = max(1, min(max_in_flight, len(items)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="coalesce-client") as pool:
            return list(pool.map(self.embed, items))

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
                 timeout_s: float = 30.0) -> None:
        """Connect lazily; arguments as for ``EmbeddingClient``."""
        self.protocol = _check_protocol(protocol)
        self.url = url or DEFAULT_URLS[protocol]
        self.model = model
        self.timeout_s = timeout_s
        self._client: Any = None

    def _get(self) -> Any:
        if self._client is None:
            if self.protocol == "grpc":
                import tritonclient.grpc.aio as aio_grpc

                self._client = aio_grpc.InferenceServerClient(self.url)
            else:
                import tritonclient.http.aio as aio_http

                self._client = aio_http.InferenceServerClient(
                    self.url, conn_timeout=self.timeout_s)
        return self._client

    async def embed(self, texts: Sequence[Text]) -> np.ndarray:
        """Embed ``texts`` in one request; float32 ``[len(texts), dim]``.

        Raises:
            ClientError: A subclass saying what went wrong, as for ``EmbeddingClient.embed``.
        """
        if self.protocol == "grpc":
            import tritonclient.grpc as tc
        else:
            import tritonclient.http as tc
        data = encode_texts(texts)
        if len(texts) == 0:
            raise InvalidInputError("texts is empty: pass at least one text")
        infer_input = tc.InferInput(INPUT_TEXT, list(data.shape), "BYTES")
        infer_input.set_data_from_numpy(data)
        outputs = [tc.InferRequestedOutput(OUTPUT_EMBEDDING)]
        client = self._get()
        try:
            if self.protocol == "grpc":
                result = await client.infer(self.model, [infer_input], outputs=outputs,
                                            client_timeout=self.timeout_s)
            else:
                result = await asyncio.wait_for(
                    client.infer(self.model, [infer_input], outputs=outputs), timeout=self.timeout_s)
        except Exception as exc:
            raise translate_error(exc, model=self.model, url=self.url, timeout_s=self.timeout_s) from exc
        return np.asarray(result.as_numpy(OUTPUT_EMBEDDING), dtype=np.float32)

    async def embed_many(self, batches: Iterable[Sequence[Text]], max_in_flight: int = 8) -> list[np.ndarray]:
        """Embed many lists of texts with at most ``max_in_flight`` requests outstanding."""
        gate = asyncio.Semaphore(max_in_flight)

        async def one(texts: Sequence[Text]) -> np.ndarray:
            async with gate:
                return await self.embed(texts)

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
