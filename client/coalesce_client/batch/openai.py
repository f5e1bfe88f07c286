"""OpenAI batch files: ``coalesce-client batch --format openai IN.jsonl OUT.jsonl``.

The input is OpenAI's batch JSONL: one request a line, ``{"custom_id", "method": "POST",
"url", "body"}``, with ``url`` one of ``/v1/embeddings``, ``/v1/rerank`` (Cohere/Jina's
shape, as the gateway serves it) or ``/v1/chat/completions``, and the model named in each
body. The output is OpenAI's batch output JSONL, one line per request line, in input order.

How each line is answered:

- Embeddings and rerank lines become rows of the bulk-job engine (``run_batch``): for each
  (model, kind), every text of every line (a rerank line: one ``(query, document)`` row per
  document) goes to a rows Parquet file in the working folder, and a row job sends them,
  length-sorted, packed to the model's ``max_batch_size``, at the concurrency it finds,
  spread over every ``--url``, resumably. Each line's body is then put together from its
  rows, in the gateway's shapes (``/v1/embeddings``: ``encoding_format`` float or base64,
  little-endian float32; ``/v1/rerank``: results best first, ``index``, ``relevance_score``,
  ``document``). A row the server refused fails its line.
- Chat lines cannot become rows here (the chat template is applied in the gateway): each
  body is POSTed to the gateway at ``--openai-url``, a few at a time, and its answer kept in
  the working folder as it comes, so a rerun sends only the lines not answered yet.

Output lines follow vLLM's ``run-batch`` (``vllm/entrypoints/openai/run_batch.py``) and
OpenAI's ``BatchRequestOutput``: ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``. A line answered has status 200, its body, and error null.
A failed line has, as vLLM writes it, a ``response`` with the HTTP status it would have had
(400 for a bad line, 404 for an unknown model, the gateway's status for a chat line it
refused) and a null body, and an ``error`` object in the fields of OpenAI's batch errors
(``code``, ``message``, ``param``: the body field at fault where there is one, ``line``: the
1-based input line). vLLM writes the error as a bare string; an object keeps OpenAI's
``code``/``message`` reading working and names the field. OpenAI refuses a whole file over
one bad line; here a bad line (not JSON, a missing or duplicate ``custom_id``, another
method or url, a field wrong) fails alone and the job goes on. Blank lines are skipped.

Usage: chat bodies carry the gateway's own counts. For embeddings and rerank,
``prompt_tokens`` is counted with ``--tokenizer`` (the model's ``tokenizer.json``,
truncated at the model's ``max_sequence_length``, as the gateway counts, for every model of
the job); without one, ``usage`` is null: the client has no tokenizer, and an estimate is not
a count.

Limits, on purpose: ``dimensions`` and token-id inputs are refused (the vectors are the
model's full width; the job sends text), ``stream: true`` is refused, and the input is held
in memory (OpenAI's own limit is 50,000 requests a file).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import http.client
import json
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from coalesce_client.batch.inputs import json_kind
from coalesce_client.batch.local import run_batch
from coalesce_client.batch.model import model_io
from coalesce_client.batch.options import BatchOptions, Clock
from coalesce_client.batch.outputs import fsync_replace
from coalesce_client.batch.planning import row_lengths
from coalesce_client.batch.state import open_work_dir
from coalesce_client.client import EmbeddingClient
from coalesce_client.errors import BatchJobError, ModelNotFoundError, RequestTimeoutError, ServerUnavailableError

EMBEDDINGS_URL: Final = "/v1/embeddings"
RERANK_URL: Final = "/v1/rerank"
CHAT_URL: Final = "/v1/chat/completions"
#: The urls a line may name, and the kind of work each is.
OPENAI_URLS: Final = {EMBEDDINGS_URL: "embeddings", RERANK_URL: "rerank", CHAT_URL: "chat"}
#: The job's state in its working folder: the input as it was.
OPENAI_STATE_FILE: Final = "openai-job.json"
#: Chat answers kept as they come (JSONL), so that a rerun sends only the others.
CHAT_ANSWERS_FILE: Final = "chat-answers.jsonl"
#: Chat requests in flight when ``concurrency`` is not given.
DEFAULT_CHAT_CONCURRENCY: Final = 8
#: Gateway statuses that say "not now" (overloaded, Triton unavailable, too slow): retried, then the job stops.
RETRIED_STATUSES: Final = frozenset({429, 502, 503, 504})
_STATE_VERSION: Final = 1


@dataclasses.dataclass(frozen=True)
class LineError:
    """Why a line failed: the HTTP status it has in the output, OpenAI's ``code``, a message, the field at fault."""

    status: int
    code: str
    message: str
    param: str | None = None

    def as_dict(self, line: int) -> dict[str, Any]:
        """The output line's ``error`` object."""
        return {"code": self.code, "message": self.message, "param": self.param, "line": line}


@dataclasses.dataclass(frozen=True)
class Answer:
    """A line's outcome: its status, request id, and body (answered) or error (failed)."""

    status: int
    request_id: str
    body: dict[str, Any] | None = None
    error: LineError | None = None


@dataclasses.dataclass(frozen=True)
class BatchLine:
    """One request line, checked.

    Attributes:
        line: 1-based line of the input.
        custom_id: The line's ``custom_id`` where it had a usable one.
        url: ``/v1/embeddings``, ``/v1/rerank`` or ``/v1/chat/completions`` (None: the line failed before).
        body: The request body.
        error: Why the line fails, found while reading it; None for a line to send.
        texts: An embeddings line's inputs, or a rerank line's documents.
        query: A rerank line's query.
    """

    line: int
    custom_id: str | None
    url: str | None = None
    body: Mapping[str, Any] | None = None
    error: LineError | None = None
    texts: tuple[str, ...] = ()
    query: str | None = None

    @property
    def kind(self) -> str | None:
        """``embeddings``, ``rerank`` or ``chat``."""
        return OPENAI_URLS.get(self.url or "")

    @property
    def model(self) -> str:
        """The model the body names."""
        return str((self.body or {}).get("model", ""))


class _Invalid(Exception):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.error = LineError(400, code, message, param)


def _text(value: object, where: str, param: str) -> str:
    """``value`` as a non-empty text that UTF-8 can carry, or ``_Invalid`` naming ``where``."""
    if not isinstance(value, str):
        raise _Invalid(f"'{where}' must be a string, found {json_kind(value)}", param)
    if not value:
        raise _Invalid(f"'{where}' is empty: give a non-empty text", param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _Invalid(f"'{where}' is not valid UTF-8 (a lone surrogate)", param) from None
    return value


def _embeddings(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("input")
    if isinstance(value, list) and value and all(isinstance(v, int | list) and not isinstance(v, bool)
                                                 for v in value):
        raise _Invalid("'input' holds token ids: a batch job sends text (a string or a list of strings)", "input")
    if isinstance(value, str):
        texts: tuple[str, ...] = (_text(value, "input", "input"),)
    elif not isinstance(value, list):
        raise _Invalid(f"'input' must be a string or a non-empty list of strings, found {json_kind(value)}", "input")
    elif not value:
        raise _Invalid("'input' is an empty list: give at least one text", "input")
    else:
        texts = tuple(_text(v, f"input[{i}]", "input") for i, v in enumerate(value))
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ("float", "base64"):
        raise _Invalid(f"'encoding_format' is {encoding!r}; it must be 'float' or 'base64'", "encoding_format")
    if body.get("dimensions") is not None:
        raise _Invalid("'dimensions' is not supported in batch jobs: the vectors are the model's full width; "
                       "leave it out", "dimensions")
    return texts


def _rerank(body: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    query = _text(body.get("query"), "query", "query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise _Invalid("'documents' must be a non-empty list of strings or of objects with 'text'", "documents")
    texts = []
    for index, item in enumerate(documents):
        if isinstance(item, dict):
            texts.append(_text(item.get("text"), f"documents[{index}].text", "documents"))
        else:
            texts.append(_text(item, f"documents[{index}]", "documents"))
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise _Invalid(f"'top_n' must be an integer of at least 1, found {top_n!r}", "top_n")
    shown = body.get("return_documents")
    if shown is not None and not isinstance(shown, bool):
        raise _Invalid(f"'return_documents' must be true or false, found {shown!r}", "return_documents")
    return query, tuple(texts)


def parse_line(line: int, data: bytes, seen: dict[str, int]) -> BatchLine:
    """Check one input line; ``seen`` maps the custom ids read so far to their lines (updated).

    Every fault becomes the line's ``error`` (naming the field), never an exception.
    """
    try:
        record = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return BatchLine(line, None, error=LineError(400, "invalid_json", f"not valid UTF-8 (byte {exc.start + 1})"))
    except json.JSONDecodeError as exc:
        return BatchLine(line, None, error=LineError(400, "invalid_json",
                                                     f"invalid JSON: {exc.msg} (column {exc.colno})"))
    if not isinstance(record, dict):
        return BatchLine(line, None, error=LineError(400, "invalid_json",
                                                     f"expected a JSON object, found {json_kind(record)}"))
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        found = "missing" if "custom_id" not in record else f"found {json_kind(custom_id)}"
        if custom_id == "":
            found = "found an empty string"
        return BatchLine(line, None, error=LineError(400, "invalid_request",
                                                     f"'custom_id' must be a non-empty string, {found}",
                                                     "custom_id"))
    first = seen.setdefault(custom_id, line)
    if first != line:
        return BatchLine(line, custom_id, error=LineError(400, "duplicate_custom_id",
                                                          f"duplicate 'custom_id' {custom_id!r}: first on line "
                                                          f"{first}", "custom_id"))
    try:
        method, url, body = record.get("method"), record.get("url"), record.get("body")
        if method != "POST":
            raise _Invalid(f"'method' is {method!r}: only 'POST' is supported", "method")
        if not isinstance(url, str) or url not in OPENAI_URLS:
            raise _Invalid(f"'url' is {url!r}: it must be one of {', '.join(OPENAI_URLS)}", "url")
        if not isinstance(body, dict):
            raise _Invalid(f"'body' must be an object, found {json_kind(body)}", "body")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise _Invalid(f"'body.model' must be a non-empty string, found {json_kind(model)}", "model")
        if url == EMBEDDINGS_URL:
            return BatchLine(line, custom_id, url, body, texts=_embeddings(body))
        if url == RERANK_URL:
            query, documents = _rerank(body)
            return BatchLine(line, custom_id, url, body, texts=documents, query=query)
        if body.get("stream"):
            raise _Invalid("'stream' is true: a batch job takes whole answers; leave it out or set it false",
                           "stream")
        return BatchLine(line, custom_id, url, body)
    except _Invalid as invalid:
        known = url if isinstance(url, str) and url in OPENAI_URLS else None
        return BatchLine(line, custom_id, known, None, error=invalid.error)


def read_batch_file(path: Path) -> list[BatchLine]:
    """Every non-blank line of an OpenAI batch file, checked, in order.

    Raises:
        BatchJobError: The file cannot be read.
    """
    if not path.is_file():
        raise BatchJobError(f"input {path} is not a file")
    seen: dict[str, int] = {}
    lines = []
    with open(path, "rb") as stream:
        for number, data in enumerate(stream, start=1):
            data = data.rstrip(b"\r\n")
            if data.strip():
                lines.append(parse_line(number, data, seen))
    return lines


# --- embeddings and rerank lines as rows ------------------------------------------------------------------------


@dataclasses.dataclass
class RowGroup:
    """The embeddings (or rerank) lines of one model: their rows, numbered 0.. in line order.

    Attributes:
        model: The model the lines name.
        kind: ``embeddings`` or ``rerank``.
        lines: The lines, in input order.
    """

    model: str
    kind: str
    lines: list[BatchLine]

    @property
    def counts(self) -> np.ndarray:
        """Rows of each line."""
        return np.array([len(line.texts) for line in self.lines], dtype=np.int64)

    @property
    def starts(self) -> np.ndarray:
        """The first row id of each line."""
        counts = self.counts
        return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)

    @property
    def rows(self) -> int:
        """Rows in all."""
        return int(self.counts.sum())

    @property
    def stem(self) -> str:
        """The group's file names in the working folder: the model's name made safe, and the kind."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.model)
        if safe != self.model or safe.startswith("."):
            safe = f"{safe.lstrip('.')}-{hashlib.sha256(self.model.encode()).hexdigest()[:8]}"
        return f"{safe}-{self.kind}"

    def table(self) -> pa.Table:
        """The rows: ``id`` (int64, 0..), ``text`` (a text, or a rerank line's query), ``pair`` (its document)."""
        texts = [text for line in self.lines for text in line.texts]
        columns: dict[str, pa.Array] = {"id": pa.array(np.arange(len(texts), dtype=np.int64))}
        if self.kind == "rerank":
            columns["text"] = pa.array([line.query for line in self.lines for _ in line.texts], type=pa.string())
            columns["pair"] = pa.array(texts, type=pa.string())
        else:
            columns["text"] = pa.array(texts, type=pa.string())
        return pa.table(columns)


def row_groups(lines: Sequence[BatchLine]) -> list[RowGroup]:
    """The lines to send as rows, grouped by (model, kind), in order of first appearance."""
    groups: dict[tuple[str, str], RowGroup] = {}
    for line in lines:
        if line.error is None and line.kind in ("embeddings", "rerank"):
            key = (line.model, str(line.kind))
            groups.setdefault(key, RowGroup(line.model, str(line.kind), [])).lines.append(line)
    return list(groups.values())


def write_rows_file(group: RowGroup, path: Path) -> bool:
    """Write ``group``'s rows to ``path`` unless it is there already (an earlier run's); returns whether written.

    An earlier run's file is kept as it is: the row job's resume state checks its size and time.
    """
    if path.is_file():
        return False
    temporary = path.with_name(path.name + ".tmp")
    pq.write_table(group.table(), temporary)
    fsync_replace(temporary, path)
    return True


def _task(config: Mapping[str, Any]) -> str:
    """The model's ``task`` parameter; ``embedding`` where unset, the backend's default."""
    return str(config.get("parameters", {}).get("task", {}).get("string_value") or "embedding")


def probe_model(clients: Sequence[EmbeddingClient], model: str, kind: str, output_name: str | None,
                log: Callable[[str], None]) -> tuple[dict[str, Any] | None, LineError | None]:
    """What the row job and the usage counts need of ``model`` (its task, its truncation), or why its lines fail.

    The model must serve the kind as the gateway would: an embeddings line needs a model of
    task ``embedding`` taking one text; a rerank line a pair scorer (two texts, one score).

    Raises:
        BatchJobError: No server answered.
        ClientError: Access denied.
    """
    url = EMBEDDINGS_URL if kind == "embeddings" else RERANK_URL
    last: Exception | None = None
    config: dict[str, Any] | None = None
    for client in clients:
        try:
            config = client.model_config()
            break
        except (ServerUnavailableError, RequestTimeoutError) as exc:
            log(f"coalesce-client: {client.url} does not answer ({type(exc).__name__}); going on without it")
            last = exc
        except ModelNotFoundError as exc:
            return None, LineError(404, "model_not_found", f"model {model!r} is not served: {exc}", "model")
    if config is None:
        raise BatchJobError(f"no server answered for model {model!r}: {last}")
    texts = [i.get("name") for i in config.get("input", []) if i.get("data_type") == "TYPE_STRING"]
    task = _task(config)
    if kind == "embeddings" and (task != "embedding" or len(texts) != 1):
        return None, LineError(400, "model_not_supported", f"model {model!r} (task {task}, "
                               f"{len(texts)} text inputs) does not serve {url}: it takes an embedding model",
                               "model")
    if kind == "rerank" and len(texts) != 2:
        return None, LineError(400, "model_not_supported", f"model {model!r} (task {task}) takes "
                               f"{len(texts)} text(s); {url} takes a pair scorer (TEXT and TEXT_PAIR)", "model")
    try:
        io = model_io(config, output=output_name, pair=kind == "rerank")
    except BatchJobError as exc:
        return None, LineError(400, "model_not_supported", f"model {model!r} does not serve {url}: {exc}", "model")
    if kind == "rerank" and not io.scalar:
        return None, LineError(400, "model_not_supported", f"model {model!r} gives {io.width} values a row; {url} "
                               "takes a pair scorer of one score a row", "model")
    return {"model": model, "task": task, "max_sequence_length": io.max_sequence_length}, None


def read_row_output(path: Path, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A row job's output as ``(values [rows, width] float32, present [rows] bool)``, indexed by row id."""
    table = pq.read_table(path)
    ids = table.column(0).to_numpy()
    column = table.column(1).combine_chunks()
    if pa.types.is_fixed_size_list(column.type):
        width = column.type.list_size
        flat = np.asarray(column.flatten().to_numpy(zero_copy_only=False), dtype=np.float32).reshape(-1, width)
    else:
        width = 1
        flat = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float32).reshape(-1, 1)
    values = np.zeros((rows, width), dtype=np.float32)
    present = np.zeros(rows, dtype=bool)
    inside = (ids >= 0) & (ids < rows)
    values[ids[inside]] = flat[inside]
    present[ids[inside]] = True
    return values, present


def read_refused(path: Path) -> dict[int, str]:
    """Row ids a row job rejected (its rejects file), with the reason; a torn last line is ignored."""
    refused: dict[int, str] = {}
    if path.is_file():
        for text in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                record = json.loads(text)
                refused[int(record["id"])] = str(record["reason"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    return refused


def _request_id() -> str:
    return f"coalesce-batch-{uuid.uuid4().hex}"


def line_tokens(group: RowGroup, info: Mapping[str, Any], tokenizer: Path | None) -> np.ndarray | None:
    """Prompt tokens of each line of ``group``, counted as the gateway does; None without a tokenizer."""
    if tokenizer is None or not group.lines:
        return None
    limit = info.get("max_sequence_length")
    texts = [text.encode("utf-8") for line in group.lines for text in line.texts]
    if group.kind == "rerank":
        queries = [str(line.query).encode("utf-8") for line in group.lines for _ in line.texts]
        if info.get("task") == "similarity":  # a bi-encoder reads each text alone
            rows = (row_lengths(queries, None, tokenizer=tokenizer, max_tokens=limit)
                    + row_lengths(texts, None, tokenizer=tokenizer, max_tokens=limit))
        else:
            rows = row_lengths(queries, texts, tokenizer=tokenizer, max_tokens=limit)
    else:
        rows = row_lengths(texts, None, tokenizer=tokenizer, max_tokens=limit)
    return np.add.reduceat(np.asarray(rows, dtype=np.int64), group.starts)


def assemble(group: RowGroup, values: np.ndarray, present: np.ndarray, refused: Mapping[int, str],
             tokens: np.ndarray | None) -> dict[int, Answer]:
    """Each line's answer (by line number) from its rows: the gateway's response body, or the error of a refused row."""
    answers: dict[int, Answer] = {}
    for line, start, tokens_used in zip(group.lines, group.starts.tolist(),
                                        tokens.tolist() if tokens is not None else [None] * len(group.lines),
                                        strict=True):
        request_id = _request_id()
        count = len(line.texts)
        ids = range(start, start + count)
        bad = [(i - start, refused[i]) for i in ids if i in refused]
        if bad:
            index, reason = bad[0]
            where = f"input[{index}]" if group.kind == "embeddings" else f"documents[{index}]"
            param = "input" if group.kind == "embeddings" else "documents"
            answers[line.line] = Answer(400, request_id, error=LineError(400, "refused_by_server",
                                                                         f"'{where}': {reason}", param))
            continue
        missing = count - int(present[start:start + count].sum())
        if missing:
            answers[line.line] = Answer(500, request_id, error=LineError(
                500, "missing_answer", f"the row job has no answer for {missing} of this line's rows"))
            continue
        usage = ({"prompt_tokens": int(tokens_used), "total_tokens": int(tokens_used)}
                 if tokens_used is not None else None)
        body = line.body or {}
        rows = values[start:start + count]
        if group.kind == "embeddings":
            if body.get("encoding_format") == "base64":
                data = [{"object": "embedding", "index": i,
                         "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")}
                        for i, v in enumerate(rows)]
            else:
                data = [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(rows)]
            answers[line.line] = Answer(200, request_id, {"object": "list", "data": data, "model": line.model,
                                                          "usage": usage})
            continue
        scores = rows[:, 0]
        top_n = body.get("top_n") or count
        shown = body.get("return_documents")
        results = []
        for index in np.argsort(-scores, kind="stable")[:top_n].tolist():
            result: dict[str, Any] = {"index": index, "relevance_score": float(scores[index])}
            if shown is None or shown:
                result["document"] = {"text": line.texts[index]}
            results.append(result)
        answers[line.line] = Answer(200, request_id, {"id": request_id, "model": line.model, "results": results,
                                                      "usage": usage, "meta": {"billed_units": {"search_units": 1}}})
    return answers


# --- chat lines through the gateway -----------------------------------------------------------------------------


class GatewayUnavailableError(BatchJobError):
    """The gateway did not answer a chat line (after its retries): the job stops; a rerun resumes."""


class ChatSender:
    """POSTs chat bodies to the gateway's ``/v1/chat/completions`` (stdlib urllib), retrying "not now" answers."""

    def __init__(self, base_url: str, *, headers: Mapping[str, str] | None = None, timeout_s: float = 600.0,
                 attempts: int = 3, sleep: Callable[[float], None] = time.sleep) -> None:
        """Send to ``base_url`` (``http://host:port``, with or without ``/v1``)."""
        base = base_url.rstrip("/")
        if not re.match(r"^https?://", base):
            raise ValueError(f"--openai-url must start with http:// or https://, got {base_url!r}")
        base = base[:-3] if base.endswith("/v1") else base
        self.url = base + CHAT_URL
        self.headers = dict(headers or {})
        self.timeout_s, self.attempts, self._sleep = timeout_s, max(1, attempts), sleep

    def _post(self, body: Mapping[str, Any], request_id: str) -> tuple[int, str, bytes]:
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        request = urllib.request.Request(self.url, data=data, method="POST", headers={
            **self.headers, "content-type": "application/json", "x-request-id": request_id})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return reply.status, reply.headers.get("x-request-id") or request_id, reply.read()
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, (exc.headers.get("x-request-id") if exc.headers else None) or request_id, exc.read()

    def send(self, body: Mapping[str, Any], line: int) -> Answer:
        """The gateway's answer to ``body``.

        Raises:
            GatewayUnavailableError: No answer, or only "not now" ones, after every attempt.
        """
        request_id = _request_id()
        problem = ""
        for attempt in range(self.attempts):
            if attempt:
                self._sleep(min(5.0, 0.5 * 2 ** (attempt - 1)))
            try:
                status, request_id, data = self._post(body, request_id)
            except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
                problem = f"cannot reach {self.url}: {getattr(exc, 'reason', exc)}"
                continue
            if status in RETRIED_STATUSES:
                problem = f"{self.url} answered {status}: {data[:300].decode('utf-8', 'replace')}"
                continue
            try:
                answer = json.loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError):
                answer = None
            if status == 200 and isinstance(answer, dict):
                return Answer(200, request_id, answer)
            detail = answer.get("error") if isinstance(answer, dict) else None
            if isinstance(detail, dict):
                return Answer(status, request_id, error=LineError(
                    status, str(detail.get("code") or detail.get("type") or "gateway_error"),
                    str(detail.get("message", "")), detail.get("param")))
            return Answer(status if status != 200 else 502, request_id, error=LineError(
                status if status != 200 else 502, "gateway_error",
                f"the gateway answered {status}: {data[:300].decode('utf-8', 'replace')}"))
        raise GatewayUnavailableError(f"line {line}: {problem} ({self.attempts} attempts)")


class ChatAnswers:
    """The chat answers kept in the working folder: one JSON line each, flushed and synced as it comes."""

    def __init__(self, path: Path) -> None:
        """Open ``path`` for appending, cutting a killed run's torn last line."""
        self.path = path
        self.done: dict[int, Answer] = {}
        if path.is_file():
            data = path.read_bytes()
            whole = data[:data.rfind(b"\n") + 1]
            if len(whole) != len(data):
                with open(path, "r+b") as stream:
                    stream.truncate(len(whole))
            for text in whole.decode("utf-8", "replace").splitlines():
                try:
                    record = json.loads(text)
                    error = record.get("error")
                    self.done[int(record["line"])] = Answer(
                        int(record["status_code"]), str(record["request_id"]), record.get("body"),
                        LineError(int(record["status_code"]), **error) if error else None)
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue
        self._stream = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def add(self, line: BatchLine, answer: Answer) -> None:
        """Keep ``answer`` to ``line``, on disk before this returns."""
        error = answer.error
        record = {"line": line.line, "custom_id": line.custom_id, "status_code": answer.status,
                  "request_id": answer.request_id, "body": answer.body,
                  "error": None if error is None else {"code": error.code, "message": error.message,
                                                       "param": error.param}}
        self._stream.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._stream.flush()
        os.fsync(self._stream.fileno())
        self.done[line.line] = answer

    def close(self) -> None:
        """Close the file."""
        self._stream.close()


def send_chat(lines: Sequence[BatchLine], sender: ChatSender, answers: ChatAnswers, *, concurrency: int,
              progress: bool = False) -> int:
    """Send every chat line not answered yet, ``concurrency`` at a time; returns how many were sent.

    Raises:
        GatewayUnavailableError: The gateway did not answer; the answers that came are kept.
    """
    todo = iter([line for line in lines if line.line not in answers.done])
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(lines), initial=len(lines) - sum(1 for line in lines if line.line not in answers.done),
                   unit="req", dynamic_ncols=True, file=sys.stderr, desc="chat")
    pending: dict[Future[Answer], BatchLine] = {}
    fatal: BaseException | None = None
    sent = 0
    executor = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="coalesce-chat")
    drained = False

    def submit() -> int:
        count = 0
        while fatal is None and len(pending) < concurrency:
            line = next(todo, None)
            if line is None:
                break
            pending[executor.submit(sender.send, dict(line.body or {}), line.line)] = line
            count += 1
        return count

    try:
        sent += submit()
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                line = pending.pop(future)
                try:
                    answers.add(line, future.result())
                except GatewayUnavailableError as exc:
                    fatal = fatal or exc
                    continue
                if bar is not None:
                    bar.update(1)
            sent += submit()
        drained = True
    finally:
        executor.shutdown(wait=drained, cancel_futures=True)
        if bar is not None:
            bar.close()
    if fatal is not None:
        raise GatewayUnavailableError(f"{fatal}; {len(answers.done)} chat answers are kept in {answers.path}: run "
                                      "the job again to resume")
    return sent


# --- the job ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class OpenAIBatchReport:
    """What one run of an OpenAI batch job did.

    Attributes:
        output: The output JSONL.
        lines: Request lines in the input.
        succeeded: Lines answered (status 200).
        failed: Lines with an error.
        row_jobs: Per (model, kind) of the embeddings and rerank lines: lines, rows, and the row
            job's report (``BatchReport.as_dict``; null where an earlier run finished it, or
            where the model cannot serve them).
        chat_sent: Chat lines this run sent.
        chat_skipped: Chat lines answered by an earlier run, not sent again.
        wall_s: Seconds of the whole run.
    """

    output: str
    lines: int
    succeeded: int
    failed: int
    row_jobs: list[dict[str, Any]]
    chat_sent: int
    chat_skipped: int
    wall_s: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self)


def _job_state(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"version": _STATE_VERSION, "input": str(path.resolve()), "input_bytes": stat.st_size,
            "input_mtime_ns": stat.st_mtime_ns}


def open_openai_work_dir(options: BatchOptions) -> bool:
    """Prepare the job's working folder; returns whether it holds an earlier run of the same input.

    Raises:
        BatchJobError: The folder holds another input's run (or this one, changed since), or the
            output exists without a working folder; ``restart`` starts over instead.
    """
    return open_work_dir(options, _job_state(options.input_path), state_file=OPENAI_STATE_FILE)


def _run_group(group: RowGroup, options: BatchOptions, clients: Sequence[EmbeddingClient],
               say: Callable[[str], None], clock: Clock) -> tuple[dict[int, Answer], dict[str, Any]]:
    """Send (or resume, or reuse) one group's row job; its lines' answers and its part of the report."""
    work = options.parts
    stem = group.stem
    output = work / f"{stem}.parquet"
    info_path = work / f"{stem}.model.json"
    summary: dict[str, Any] = {"model": group.model, "kind": group.kind, "lines": len(group.lines),
                               "rows": group.rows, "report": None}
    if info_path.is_file():
        info = json.loads(info_path.read_text())
    else:
        found, error = probe_model(clients, group.model, group.kind, options.output_name, say)
        if found is None:
            assert error is not None
            summary["error"] = error.message
            return {line.line: Answer(error.status, _request_id(), error=error) for line in group.lines}, summary
        info = found
        temporary = info_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(info) + "\n")
        fsync_replace(temporary, info_path)
    if output.is_file():  # written whole or not at all: the row job is done
        say(f"coalesce-client: {group.model} {group.kind}: done by an earlier run ({output})")
    else:
        rows_path = work / f"{stem}.rows.parquet"
        write_rows_file(group, rows_path)
        job = dataclasses.replace(options, input_path=rows_path, output_path=output, input_format="parquet",
                                  id_column="id", text_column="text",
                                  pair_column="pair" if group.kind == "rerank" else None,
                                  rejects_path=work / f"{stem}.rejects.jsonl", work_dir=work / f"{stem}.parts",
                                  restart=False)
        report = run_batch(job, clients, log=say, clock=clock)
        summary["report"] = report.as_dict()
    values, present = read_row_output(output, group.rows)
    refused = read_refused(work / f"{stem}.rejects.jsonl")
    tokens = line_tokens(group, info, options.tokenizer)
    return assemble(group, values, present, refused, tokens), summary


def output_record(line: BatchLine, answer: Answer) -> dict[str, Any]:
    """The output line of ``line``: vLLM's ``BatchRequestOutput`` shape (the module's docstring)."""
    error = answer.error
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": answer.status, "request_id": answer.request_id,
                         "body": answer.body if error is None else None},
            "error": None if error is None else error.as_dict(line.line)}


def write_output(path: Path, records: Iterator[dict[str, Any]]) -> None:
    """Write the output JSONL whole: to ``<output>.tmp``, synced, then renamed into place."""
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w", encoding="utf-8") as stream:
        for record in records:
            stream.write(json.dumps(record, ensure_ascii=False) + "\n")
    fsync_replace(temporary, path)


def run_openai_batch(options: BatchOptions, clients_for: Callable[[str], Sequence[EmbeddingClient]], *,
                     openai_url: str | None = None, headers: Mapping[str, str] | None = None,
                     chat_timeout_s: float = 600.0, chat_attempts: int = 3, log: Callable[[str], None] | None = None,
                     clock: Clock = time.monotonic, sender: ChatSender | None = None) -> OpenAIBatchReport:
    """Run (or resume) an OpenAI batch file: ``options.input_path`` to the output JSONL ``options.output_path``.

    Args:
        options: The job: input, output, working folder (``parts``), ``restart``, ``keep_parts``,
            ``tokenizer`` (usage counts), and the row jobs' settings (requests, concurrency, parts,
            progress; ``concurrency`` is also the chat lines' in flight, default
            ``DEFAULT_CHAT_CONCURRENCY``). Its columns and format are set here.
        clients_for: One client per server for a model's name (same servers and settings for each model).
        openai_url: The gateway (``http://host:port``) that answers the chat lines; without it they fail.
        headers: Sent with each chat request (an ``authorization`` key of the gateway).
        chat_timeout_s: Seconds a chat request may take.
        chat_attempts: Attempts of a chat request the gateway did not answer or answered "not now".
        log: Where messages go (default: standard error).
        clock: Monotonic seconds.
        sender: The chat sender (default: a ``ChatSender`` to ``openai_url``).

    Raises:
        BatchJobError: The job cannot start, or stopped (no server answered, the gateway is gone);
            what was finished is kept, and running it again resumes.
        ClientError: Access denied.
    """
    started = clock()

    def say(text: str) -> None:
        (log or (lambda t: sys.stderr.write(t + "\n")))(text)

    lines = read_batch_file(options.input_path)
    if sender is None and openai_url:
        sender = ChatSender(openai_url, headers=headers, timeout_s=chat_timeout_s, attempts=chat_attempts)
    resumed = open_openai_work_dir(options)
    work = options.parts
    if resumed:
        say(f"coalesce-client: resuming {options.output_path} from {work}")
    answers: dict[int, Answer] = {}
    for line in lines:
        if line.error is not None:
            answers[line.line] = Answer(line.error.status, _request_id(), error=line.error)
    row_jobs = []
    groups = row_groups(lines)
    # One Ray session for every row job of the file: Ray started again in one process may not come up.
    # Imported here: the Ray engine imports coalesce_client.ray, which imports this package.
    from coalesce_client.batch.ray_engine import ray_session

    with ray_session(options) if options.engine == "ray" and groups else contextlib.nullcontext():
        for group in groups:
            found, summary = _run_group(group, options, clients_for(group.model), say, clock)
            answers.update(found)
            row_jobs.append(summary)
    chat = [line for line in lines if line.error is None and line.kind == "chat"]
    chat_sent = chat_skipped = 0
    if chat:
        kept = ChatAnswers(work / CHAT_ANSWERS_FILE)
        try:
            chat_skipped = sum(1 for line in chat if line.line in kept.done)
            if sender is not None:
                chat_sent = send_chat(chat, sender, kept, progress=options.progress,
                                      concurrency=options.concurrency or DEFAULT_CHAT_CONCURRENCY)
        finally:
            kept.close()
        error = LineError(400, "no_gateway", "chat completions are answered by the gateway (the chat template lives "
                          "there): give its address with --openai-url, e.g. http://127.0.0.1:9000", "url")
        answers.update({line.line: kept.done.get(line.line) or Answer(400, _request_id(), error=error)
                        for line in chat})
    write_output(options.output_path, (output_record(line, answers[line.line]) for line in lines))
    if not options.keep_parts:
        shutil.rmtree(work)
    succeeded = sum(1 for line in lines if answers[line.line].error is None)
    return OpenAIBatchReport(output=str(options.output_path), lines=len(lines), succeeded=succeeded,
                             failed=len(lines) - succeeded, row_jobs=row_jobs, chat_sent=chat_sent,
                             chat_skipped=chat_skipped, wall_s=clock() - started)
