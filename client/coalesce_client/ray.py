"""Ray Data callables that run a served text model over a dataset's rows: ``Embed`` and ``Score``.

Each actor of a ``map_batches`` holds one client (spread over one or more Triton servers)
and, per batch, sorts the rows by length, cuts them into requests as large as the model
takes (``plan_requests``, as the local bulk job does), sends them a few at a time and puts
the answers back in row order::

    import ray
    from coalesce_client.ray import Embed

    ds = ray.data.read_parquet("corpus/")
    ds = ds.map_batches(Embed, fn_constructor_kwargs={"urls": ["triton-0:8001", "triton-1:8001"],
                                                      "model": "minilm"},
                        compute=ray.data.ActorPoolStrategy(size=4), batch_size=4096, batch_format="pyarrow",
                        num_cpus=0.25)
    ds.write_parquet("vectors/")

The batch comes back with every input column, the model's output (``embedding``, ``scores``:
a fixed-size list per row, or one value) and ``error``: null, or why the row has no output
(an id or text that is missing or mistyped, or a row the server refused). A server that
stops answering is left alone for a while and its requests go to the others; when none
answers the call raises, and Ray retries the batch (``max_task_retries``).

``urls`` may name ``node``: the URL in the environment variable ``COALESCE_TRITON_URL`` of the
Ray node the actor runs on (set it when starting the node, e.g. ``COALESCE_TRITON_URL=
127.0.0.1:8001 ray start ...``), so each node's actors use the server beside them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa

from coalesce_client.batch.endpoints import EndpointPool
from coalesce_client.batch.inputs import MISSING, RowChecker
from coalesce_client.batch.model import ModelIO, discover
from coalesce_client.batch.planning import plan_requests, row_lengths
from coalesce_client.client import EmbeddingClient, TlsOptions
from coalesce_client.errors import (
    BatchJobError,
    ClientError,
    InvalidInputError,
    ModelNotFoundError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
)
from coalesce_client.retry import RetryPolicy

#: The environment variable naming the Triton server beside a Ray node (``urls`` entry ``node``).
NODE_URL_VARIABLE: Final = "COALESCE_TRITON_URL"
#: The ``urls`` entry that stands for ``NODE_URL_VARIABLE``.
NODE: Final = "node"
#: The column of each row's error (null when the row has its output).
ERROR_COLUMN: Final = "error"


def resolve_urls(urls: Sequence[str] | str, environ: Mapping[str, str] | None = None) -> list[str]:
    """``urls`` with ``node`` replaced by this node's ``COALESCE_TRITON_URL`` (left out where it is not set).

    Raises:
        ValueError: No URL is left.
    """
    environ = os.environ if environ is None else environ
    given = [urls] if isinstance(urls, str) else list(urls)
    resolved: list[str] = []
    for url in given:
        if url == NODE:
            if environ.get(NODE_URL_VARIABLE):
                resolved.append(environ[NODE_URL_VARIABLE])
        elif url not in resolved:
            resolved.append(url)
    if not resolved:
        raise ValueError(f"no server: urls {given} name only {NODE!r}, and {NODE_URL_VARIABLE} is not set on this "
                         "node")
    return list(dict.fromkeys(resolved))


class RowModel:
    """A served text model as a Ray Data callable: rows of a batch in, the batch with the model's output out.

    ``Embed`` and ``Score`` name the two uses; the class takes any model whose inputs are one
    or two texts per row and whose chosen output has a fixed size.
    """

    #: Whether the model takes a second text per row.
    pair: bool = False

    def __init__(self, urls: Sequence[str] | str, model: str, *, text_column: str = "text",
                 pair_column: str | None = None, id_column: str = "id", output_name: str | None = None,
                 output_column: str | None = None, protocol: str = "grpc", timeout_s: float = 60.0,
                 max_attempts: int | None = None, headers: Mapping[str, str] | None = None,
                 tls: TlsOptions | None = None, in_flight: int = 2, cooldown_s: float = 5.0,
                 tokenizer: str | None = None, log: Callable[[str], None] | None = None) -> None:
        """Connect to ``model`` on ``urls`` (``host:port``; ``node``: the server beside this Ray node).

        Args:
            urls: Servers serving the model; requests go to the least busy one that answers.
            model: The model's name.
            text_column: Column of the texts.
            pair_column: Column of the second texts (``Score`` with a cross-encoder).
            id_column: Column of the row ids: checked (strings or integers) and passed through.
            output_name: The model output to return; None: its only one.
            output_column: The output's column; None: ``output_name`` in lower case.
            protocol: ``grpc`` or ``http``.
            timeout_s: Deadline of each request, retries included.
            max_attempts: Attempts per request on one server before it is left alone.
            headers: Sent with every request (e.g. ``authorization``).
            tls: gRPC over TLS.
            in_flight: Requests of one batch sent at once: one computing while the next travels.
            cooldown_s: Seconds a server that failed is left alone.
            tokenizer: The model's ``tokenizer.json`` (a path on every node): rows are sorted by
                exact token counts; None: by an estimate (``estimate_tokens``).
            log: Where messages go (default: standard error, which Ray collects per worker).

        Raises:
            BatchJobError: No server answers, or the model does not take texts.
            ClientError: The model is unknown or access is denied.
        """
        if in_flight < 1:
            raise ValueError(f"in_flight must be at least 1, got {in_flight}")
        if self.pair and not pair_column:
            raise ValueError(f"{type(self).__name__} needs pair_column: the column of the second texts")
        self.text_column, self.pair_column, self.id_column = text_column, pair_column, id_column
        self._log = log or (lambda line: print(line, flush=True))  # Ray's worker log
        retry = RetryPolicy(max_attempts=max_attempts) if max_attempts else None
        clients = [EmbeddingClient(url, protocol=protocol, model=model, timeout_s=timeout_s, retry=retry, tls=tls,
                                   headers=headers) for url in resolve_urls(urls)]
        self.io: ModelIO
        self.io, answered = discover(clients, self._log, output=output_name, pair=pair_column is not None)
        for client in clients:
            if client not in answered:
                client.close()
        self.output_column = output_column or self.io.column
        self.pool = EndpointPool(answered, cooldown_s=cooldown_s)
        self._lock = threading.Lock()  # the pool's counts: requests of a batch are sent from several threads
        self._executor = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="coalesce-ray")
        self.max_failures = 2 * len(answered) + 1
        self.tokenizer = Path(tokenizer) if tokenizer else None

    # --- one batch -------------------------------------------------------------------------------------------

    def __call__(self, batch: pa.Table | Mapping[str, Any]) -> pa.Table:
        """The batch's rows (a pyarrow table, or columns as numpy arrays) with the output and error columns added."""
        table = batch if isinstance(batch, pa.Table) else pa.table(dict(batch))
        _, texts, pairs, errors = self._check(table)
        good = np.array([i for i, error in enumerate(errors) if error is None], dtype=np.int64)
        values = np.zeros((table.num_rows, self.io.width), dtype=self.io.dtype)
        if len(good):
            refused = self._compute(good, texts, pairs, values)
            for row, reason in refused.items():
                errors[row] = reason
        has = np.array([error is None for error in errors], dtype=bool)
        return table.append_column(self.output_column, self._column(values, has)).append_column(
            ERROR_COLUMN, pa.array(errors, type=pa.string()))

    def _check(self, table: pa.Table) -> tuple[list[Any], list[bytes], list[bytes] | None, list[str | None]]:
        """Each row's id and texts, and the reason a row cannot be sent (None where it can)."""
        columns = [self.id_column, self.text_column, *([self.pair_column] if self.pair_column else [])]
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise BatchJobError(f"the dataset has no column {', '.join(map(repr, missing))} (it has "
                                f"{', '.join(table.column_names)})")
        ids = table.column(self.id_column).to_pylist()
        texts = table.column(self.text_column).to_pylist()
        pairs = table.column(self.pair_column).to_pylist() if self.pair_column else None
        checker = RowChecker(self.id_column, self.text_column, self.pair_column)
        errors: list[str | None] = [None] * len(ids)
        encoded: list[bytes] = [b""] * len(ids)
        encoded_pairs: list[bytes] | None = [b""] * len(ids) if pairs is not None else None
        for row, row_id in enumerate(ids):
            before = len(checker.rows.rejects)
            checker.add(row + 1, "", row_id, texts[row], pairs[row] if pairs is not None else MISSING)
            if len(checker.rows.rejects) > before:
                reason = checker.rows.rejects[-1].reason
                # Ids are checked for their type only: unique ids are the dataset's to keep (a batch sees its own).
                if not reason.startswith("duplicate "):
                    errors[row] = reason
                    continue
            encoded[row] = texts[row].encode("utf-8")
            if encoded_pairs is not None and pairs is not None:
                encoded_pairs[row] = pairs[row].encode("utf-8")
        return ids, encoded, encoded_pairs, errors

    def _column(self, values: np.ndarray, has: np.ndarray) -> pa.Array:
        """The output as an Arrow column: a value per row (one-value outputs) or a fixed-size list; null where none."""
        kind = pa.from_numpy_dtype(self.io.dtype)
        mask = pa.array(~has)
        if self.io.scalar:
            return pa.array(values.reshape(-1), type=kind, mask=~has)
        flat = pa.array(values.reshape(-1), type=kind)
        return pa.FixedSizeListArray.from_arrays(flat, self.io.width, mask=mask)

    def _compute(self, rows: np.ndarray, texts: list[bytes], pairs: list[bytes] | None,
                 values: np.ndarray) -> dict[int, str]:
        """Fill ``values`` for ``rows``; returns the rows the server refused, with its reason."""
        lengths = row_lengths([texts[i] for i in rows], [pairs[i] for i in rows] if pairs is not None else None,
                              tokenizer=self.tokenizer, max_tokens=self.io.max_sequence_length)
        sizes = np.array([len(texts[i]) + (len(pairs[i]) if pairs is not None else 0) for i in rows], dtype=np.int64)
        plan = plan_requests(lengths, sizes, max_rows=self.io.max_rows, max_bytes=self.io.max_request_bytes,
                             max_tokens=self.io.max_batch_tokens, seed=None)
        refused: dict[int, str] = {}
        futures = [self._executor.submit(self._request, rows[chunk], texts, pairs, values, refused) for chunk in plan]
        for future in futures:
            future.result()  # a request that no server answered raises here: Ray retries the batch
        return refused

    def _request(self, chunk: np.ndarray, texts: list[bytes], pairs: list[bytes] | None, values: np.ndarray,
                 refused: dict[int, str]) -> None:
        """Send rows ``chunk`` until answered; a refused request is split until its bad rows stand alone."""
        failures = 0
        while True:
            endpoint = None
            while endpoint is None:
                with self._lock:
                    endpoint = self.pool.pick(time.monotonic())
                    wait_s = self.pool.next_up_s(time.monotonic())
                    if endpoint is not None:
                        endpoint.in_flight += 1
                if endpoint is None:
                    time.sleep(min(1.0, max(0.01, wait_s)))
            inputs = {self.io.text_input: _objects([texts[i] for i in chunk])}
            if self.io.pair_input is not None and pairs is not None:
                inputs[self.io.pair_input] = _objects([pairs[i] for i in chunk])
            try:
                answer = endpoint.client.infer(inputs, [self.io.output])
            except InvalidInputError as error:
                if len(chunk) == 1:
                    refused[int(chunk[0])] = f"refused by the server: {error}"
                    return
                half = len(chunk) // 2
                self._request(chunk[:half], texts, pairs, values, refused)
                self._request(chunk[half:], texts, pairs, values, refused)
                return
            except (ServerUnavailableError, RequestTimeoutError, ServerError, ModelNotFoundError) as error:
                failures += 1
                with self._lock:
                    self.pool.fail(endpoint, time.monotonic())
                self._log(f"coalesce-client: {endpoint.url}: {type(error).__name__}: {error}; its request goes to "
                          "another server or waits")
                if failures >= self.max_failures:
                    raise BatchJobError(f"a request failed {failures} times, on every server: {error}") from error
                continue
            finally:
                with self._lock:
                    endpoint.in_flight -= 1
            array = np.asarray(answer[self.io.output])
            if array.size != len(chunk) * self.io.width:
                raise BatchJobError(f"{endpoint.url} answered {self.io.output} of shape {array.shape} for "
                                    f"{len(chunk)} rows of {list(self.io.output_dims)}")
            values[chunk] = array.reshape(len(chunk), self.io.width)
            with self._lock:
                endpoint.requests += 1
                endpoint.rows += len(chunk)
            return

    def __del__(self) -> None:
        """Close the clients when Ray lets the actor go."""
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        for endpoint in getattr(getattr(self, "pool", None), "endpoints", []):
            with contextlib.suppress(ClientError):
                endpoint.client.close()


class Embed(RowModel):
    """An embedding model (one text a row) as a Ray Data callable; adds the vectors and ``error``."""


class Score(RowModel):
    """A pair scorer (a cross-encoder: two texts a row, ``pair_column``) as a Ray Data callable; adds the scores."""

    pair = True


def _objects(values: Sequence[bytes]) -> np.ndarray:
    """``values`` as a ``[n, 1]`` object array: Triton's BYTES rows."""
    array = np.empty((len(values), 1), dtype=np.object_)
    array[:, 0] = values
    return array
