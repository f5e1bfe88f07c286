"""Bulk jobs: a file of (id, text) rows through a served text model into one Parquet file, resumably.

``coalesce-client batch INPUT OUTPUT`` (or ``run_batch``) reads JSONL, CSV or Parquet rows
of an id and a text (and a second text for a pair model such as a cross-encoder), sorts
them by length on the client, cuts them into requests as large as the model takes, and
sends them to one or more servers with a concurrency it finds by itself. Results go to
Parquet part files as they come back, and to one merged Parquet file at the end: the ids
and, per the model's output, a vector (an embedding model) or scores (a classifier).

What makes it safe to run on a large file:

- A malformed row (invalid JSON, a missing or mistyped id or text, an empty text, a
  duplicate id) goes to the rejects file with its 1-based line number, its raw line and
  the reason; the rest of the file goes on. A row the server refuses (``INVALID_ARG``) is
  found by splitting its request and goes there too.
- A killed job loses at most its requests in flight and the answers of the last part
  interval: on restart it reads the ids already in its part files and sends only the others.
- Several servers share the work (each request goes to the least busy server that is up);
  a server that stops answering is left alone for a while and its requests go elsewhere.

Rows are sent in length-sorted requests (padding in the model's passes stays small, as in
the offline limit), but the requests go out in a seeded random order, so that rows/s stays
steady over the job: the progress bar's ETA holds, and the concurrency search compares like
with like. The output is therefore not in input order: join on the id.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import math
import os
import random
import re
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import IO, Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from coalesce_client.client import EmbeddingClient
from coalesce_client.errors import (
    BatchJobError,
    ClientError,
    InvalidInputError,
    ModelNotFoundError,
    RequestRejectedError,
    RequestTimeoutError,
    ServerError,
    ServerUnavailableError,
)

#: Input formats, and the file suffixes that name them.
FORMATS: Final = ("jsonl", "csv", "parquet")
SUFFIX_FORMATS: Final = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
#: The backend's default ``max_request_bytes``, for a model whose config does not set it.
DEFAULT_MAX_REQUEST_BYTES: Final = 4 * 1024 * 1024
#: Most characters of a raw line kept in a reject record (a bad line may be huge).
RAW_CHARS: Final = 4096
#: Most reject messages printed; the rejects file has every one.
MAX_REJECT_MESSAGES: Final = 20
#: Files of a job's working folder.
PART_PREFIX: Final = "part-"
STATE_FILE: Final = "job.json"
SERVER_REJECTS_FILE: Final = "server-rejects.jsonl"
STATE_VERSION: Final = 1
#: Triton's numeric output types, as numpy types.
TRITON_DTYPES: Final = {"TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
                        "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64,
                        "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
                        "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}

Id = int | str
Clock = Callable[[], float]


# --- options -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BatchOptions:
    """What one bulk job reads, where it writes, and how it sends.

    Attributes:
        input_path: JSONL (one object per line), CSV (with a header) or Parquet file.
        output_path: The merged Parquet file written at the end.
        id_column: Column (JSON key) of the row ids: strings or integers, unique; the output's id column.
        text_column: Column of the texts (non-empty strings).
        pair_column: Column of the second texts, for a pair model (``TEXT_PAIR``, a cross-encoder).
        input_format: ``jsonl``, ``csv`` or ``parquet``; None: from the input's suffix.
        output_name: The model output to write; None: the model's only output.
        rejects_path: JSONL of the rejected rows; None: ``<output>.rejects.jsonl``.
        work_dir: Part files and the job's state; None: ``<output>.parts``. Removed once the output is written.
        rows_per_request: Rows per request; None: the model's ``max_batch_size``.
        max_request_bytes: Text bytes per request; None: the model's ``max_request_bytes`` (4 MiB by default).
        concurrency: Requests in flight; None: found by ``ConcurrencySearch``.
        max_concurrency: Upper bound of the search.
        part_rows: Rows of a part file; a part is written when this many answers wait.
        part_interval_s: Seconds between part files at most, so a kill loses at most this much work.
        restart: Start over: discard the part files of an earlier run of this output.
        keep_parts: Keep the working folder after the merge.
        progress: Show a progress bar (rows/s, ETA) on standard error.
        seed: Seed of the order the requests go out in.
        cooldown_s: Seconds a server that did not answer (after its retries) is left alone.
        tokenizer: The served model's Hugging Face ``tokenizer.json``: rows are sorted by their
            exact token counts (truncated at the model's ``max_sequence_length``). None: by an
            estimate from their words and punctuation (``estimate_tokens``).
    """

    input_path: Path
    output_path: Path
    id_column: str = "id"
    text_column: str = "text"
    pair_column: str | None = None
    input_format: str | None = None
    output_name: str | None = None
    rejects_path: Path | None = None
    work_dir: Path | None = None
    rows_per_request: int | None = None
    max_request_bytes: int | None = None
    concurrency: int | None = None
    max_concurrency: int = 32
    part_rows: int = 4096
    part_interval_s: float = 2.0
    restart: bool = False
    keep_parts: bool = False
    progress: bool = True
    seed: int = 0
    cooldown_s: float = 5.0
    tokenizer: Path | None = None

    def __post_init__(self) -> None:
        """Reject settings that cannot work, naming the field and value."""
        object.__setattr__(self, "input_path", Path(self.input_path))
        object.__setattr__(self, "output_path", Path(self.output_path))
        if self.tokenizer is not None:
            object.__setattr__(self, "tokenizer", Path(self.tokenizer))
            if not self.tokenizer.is_file():
                raise ValueError(f"tokenizer {str(self.tokenizer)!r} is not a file")
        if self.input_format is not None and self.input_format not in FORMATS:
            raise ValueError(f"input_format must be one of {', '.join(FORMATS)}, got {self.input_format!r}")
        for name in ("rows_per_request", "max_request_bytes", "concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value!r}")
        for name in ("max_concurrency", "part_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        for name in ("part_interval_s", "cooldown_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        columns = [self.id_column, self.text_column, *([self.pair_column] if self.pair_column else [])]
        if len(set(columns)) != len(columns) or not all(columns):
            raise ValueError(f"the id, text and pair columns must be distinct names, got {columns}")

    @property
    def format(self) -> str:
        """The input's format: as given, else from its suffix."""
        if self.input_format:
            return self.input_format
        found = SUFFIX_FORMATS.get(self.input_path.suffix.lower())
        if found is None:
            raise BatchJobError(f"cannot tell the format of {self.input_path} from its suffix: name it "
                                f"({', '.join(SUFFIX_FORMATS)}) or give the format ({', '.join(FORMATS)})")
        return found

    @property
    def rejects(self) -> Path:
        """Where rejected rows go."""
        return self.rejects_path or self.output_path.with_name(self.output_path.name + ".rejects.jsonl")

    @property
    def parts(self) -> Path:
        """The working folder: part files and the job's state."""
        return self.work_dir or self.output_path.with_name(self.output_path.name + ".parts")


# --- reading -------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reject:
    """A row left out of the job, and why.

    Attributes:
        line: 1-based line where the row starts (JSONL, CSV; the header is line 1), or its 1-based row (Parquet).
        reason: What is wrong with it.
        raw: The raw line (at most ``RAW_CHARS`` characters), or the row's values as JSON.
        id: The row's id where it had a usable one.
    """

    line: int
    reason: str
    raw: str
    id: Id | None = None

    def as_dict(self) -> dict[str, Any]:
        """The rejects file's record."""
        return {"line": self.line, "id": self.id, "reason": self.reason, "raw": self.raw}

    def message(self, noun: str = "line") -> str:
        """One line for a person: ``line 7: invalid JSON (...)``."""
        return f"{noun} {self.line}: {self.reason}"


@dataclasses.dataclass
class InputRows:
    """The valid rows of an input file, in file order, and the rejected ones."""

    ids: list[Id]
    texts: list[bytes]
    pairs: list[bytes] | None
    lines: list[int]
    rejects: list[Reject]
    #: What a row number is called in messages: ``line`` (JSONL, CSV) or ``row`` (Parquet).
    noun: str = "line"

    def __len__(self) -> int:
        return len(self.ids)


_MISSING: Final = object()


def _kind(value: object) -> str:
    """A value's JSON-ish type name, for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _raw(text: str) -> str:
    """``text`` cut to ``RAW_CHARS``, with bytes that were not UTF-8 (surrogates) written as escapes."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= RAW_CHARS else text[:RAW_CHARS] + f"... ({len(text)} characters)"


class _Collector:
    """Checks rows one by one and keeps the valid ones; every reason names the column and what it holds."""

    def __init__(self, id_column: str, text_column: str, pair_column: str | None) -> None:
        self.id_column, self.text_column, self.pair_column = id_column, text_column, pair_column
        self.rows = InputRows(ids=[], texts=[], pairs=[] if pair_column else None, lines=[], rejects=[])
        self._first_line: dict[Id, int] = {}
        self._id_kind: str | None = None

    def reject(self, line: int, reason: str, raw: str, row_id: Id | None = None) -> None:
        self.rows.rejects.append(Reject(line, reason, _raw(raw), row_id))

    def _text(self, column: str, value: object) -> bytes | str:
        """The text as UTF-8, or the reason it is not one."""
        if value is _MISSING:
            return f"missing {column!r}"
        if not isinstance(value, str):
            return f"{column!r} must be a string, got {_kind(value)}"
        if not value:
            return f"{column!r} is empty"
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{column!r} is not valid UTF-8"

    def add(self, line: int, raw: str, row_id: object, text: object, pair: object = _MISSING) -> None:
        if row_id is _MISSING or row_id is None:
            self.reject(line, f"missing {self.id_column!r}" if row_id is _MISSING else f"{self.id_column!r} is null",
                        raw)
            return
        if isinstance(row_id, bool) or not isinstance(row_id, int | str):
            self.reject(line, f"{self.id_column!r} must be a string or an integer, got {_kind(row_id)}", raw)
            return
        if isinstance(row_id, int) and not -2**63 <= row_id < 2**63:
            self.reject(line, f"{self.id_column!r} {row_id} does not fit in 64 bits", raw)
            return
        if isinstance(row_id, str) and not row_id.strip():
            self.reject(line, f"{self.id_column!r} is empty", raw)
            return
        if isinstance(row_id, str) and isinstance(self._text(self.id_column, row_id), str):
            self.reject(line, f"{self.id_column!r} is not valid UTF-8", raw)
            return
        kind = "integer" if isinstance(row_id, int) else "string"
        if self._id_kind is None:
            self._id_kind = kind
        elif kind != self._id_kind:
            self.reject(line, f"{self.id_column!r} {row_id!r} is {_kind(row_id)}, but the ids before it are "
                              f"{self._id_kind}s", raw, row_id)
            return
        encoded = self._text(self.text_column, text)
        if isinstance(encoded, str):
            self.reject(line, encoded, raw, row_id)
            return
        encoded_pair = b""
        if self.pair_column is not None:
            checked = self._text(self.pair_column, pair)
            if isinstance(checked, str):
                self.reject(line, checked, raw, row_id)
                return
            encoded_pair = checked
        first = self._first_line.get(row_id)
        if first is not None:
            self.reject(line, f"duplicate {self.id_column!r} {row_id!r}: first on line {first}", raw, row_id)
            return
        self._first_line[row_id] = line
        self.rows.ids.append(row_id)
        self.rows.texts.append(encoded)
        if self.rows.pairs is not None:
            self.rows.pairs.append(encoded_pair)
        self.rows.lines.append(line)


def read_jsonl(path: Path, id_column: str = "id", text_column: str = "text",
               pair_column: str | None = None) -> InputRows:
    """Rows of a JSONL file: one JSON object per line; blank lines are skipped."""
    rows = _Collector(id_column, text_column, pair_column)
    with open(path, "rb") as stream:
        for number, data in enumerate(stream, start=1):
            data = data.rstrip(b"\r\n")
            raw = data.decode("utf-8", "replace")
            if not data.strip():
                continue
            try:
                record = json.loads(data.decode("utf-8"))
            except UnicodeDecodeError as exc:
                rows.reject(number, f"not valid UTF-8 (byte {exc.start + 1})", raw)
                continue
            except json.JSONDecodeError as exc:
                rows.reject(number, f"invalid JSON: {exc.msg} (column {exc.colno})", raw)
                continue
            if not isinstance(record, dict):
                rows.reject(number, f"expected a JSON object, got {_kind(record)}", raw)
                continue
            rows.add(number, raw, record.get(id_column, _MISSING), record.get(text_column, _MISSING),
                     record.get(pair_column, _MISSING) if pair_column else _MISSING)
    return rows.rows


def read_csv(path: Path, id_column: str = "id", text_column: str = "text",
             pair_column: str | None = None) -> InputRows:
    """Rows of a CSV file with a header line; ids are read as strings. A quoted field may span lines.

    Raises:
        BatchJobError: The header lacks a column the job needs.
    """
    rows = _Collector(id_column, text_column, pair_column)
    consumed: list[str] = []

    def lines(stream: IO[str]) -> Iterator[str]:
        for line in stream:
            consumed.append(line)
            yield line

    limit = csv.field_size_limit()
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # a text may be far longer than the 128 KiB default
    try:
        # surrogateescape: bytes that are not UTF-8 survive reading and are rejected per row, not per file.
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as stream:
            reader = csv.reader(lines(stream))
            try:
                header = next(reader)
            except StopIteration:
                raise BatchJobError(f"{path} is empty: a CSV input needs a header line") from None
            except csv.Error as exc:
                raise BatchJobError(f"{path} line 1: cannot read the CSV header: {exc}") from None
            missing = [c for c in (id_column, text_column, pair_column) if c and c not in header]
            if missing:
                raise BatchJobError(f"{path}: the CSV header has no column {', '.join(map(repr, missing))} "
                                    f"(it has {', '.join(map(repr, header))})")
            where = {name: header.index(name) for name in (id_column, text_column, pair_column) if name}
            consumed.clear()
            start = reader.line_num + 1
            while True:
                try:
                    fields = next(reader)
                except StopIteration:
                    break
                except csv.Error as exc:
                    rows.reject(start, f"invalid CSV: {exc}", "".join(consumed).rstrip("\r\n"))
                    consumed.clear()
                    start = reader.line_num + 1
                    continue
                raw = "".join(consumed).rstrip("\r\n")
                consumed.clear()
                line, start = start, reader.line_num + 1
                if not fields:
                    continue  # a blank line
                if len(fields) != len(header):
                    rows.reject(line, f"expected {len(header)} fields, found {len(fields)}", raw)
                    continue
                row_id: object = fields[where[id_column]]
                rows.add(line, raw, row_id if row_id != "" else _MISSING, fields[where[text_column]],
                         fields[where[pair_column]] if pair_column else _MISSING)
    finally:
        csv.field_size_limit(limit)
    return rows.rows


def _is_text_type(kind: pa.DataType) -> bool:
    if pa.types.is_dictionary(kind):
        return _is_text_type(kind.value_type)
    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind))


def read_parquet(path: Path, id_column: str = "id", text_column: str = "text",
                 pair_column: str | None = None) -> InputRows:
    """Rows of a Parquet file; a reject's ``line`` is its 1-based row.

    Raises:
        BatchJobError: A column is missing, or has a type that cannot hold ids or texts.
    """
    rows = _Collector(id_column, text_column, pair_column)
    rows.rows.noun = "row"
    try:
        source = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise BatchJobError(f"{path} is not a readable Parquet file: {exc}") from None
    schema = source.schema_arrow
    columns = [c for c in (id_column, text_column, pair_column) if c]
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise BatchJobError(f"{path}: no column {', '.join(map(repr, missing))} (it has {', '.join(schema.names)})")
    id_type = schema.field(id_column).type
    if not (pa.types.is_integer(id_type) or _is_text_type(id_type)):
        raise BatchJobError(f"{path}: column {id_column!r} is {id_type}: ids must be strings or integers")
    for column in columns[1:]:
        if not _is_text_type(schema.field(column).type):
            raise BatchJobError(f"{path}: column {column!r} is {schema.field(column).type}: texts must be strings")
    number = 0
    for batch in source.iter_batches(columns=columns, batch_size=65536):
        values = {name: batch.column(name).to_pylist() for name in columns}
        for i in range(batch.num_rows):
            number += 1
            record = {name: values[name][i] for name in columns}
            raw = json.dumps(record, ensure_ascii=False, default=str)
            rows.add(number, raw, record[id_column], record[text_column],
                     record[pair_column] if pair_column else _MISSING)
    return rows.rows


def read_input(options: BatchOptions) -> InputRows:
    """The input's rows, by its format.

    Raises:
        BatchJobError: The input cannot be read at all (missing, no such column, a header without them).
    """
    if not options.input_path.is_file():
        raise BatchJobError(f"input {options.input_path} is not a file")
    reader = {"jsonl": read_jsonl, "csv": read_csv, "parquet": read_parquet}[options.format]
    return reader(options.input_path, options.id_column, options.text_column, options.pair_column)


# --- the model -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelIO:
    """What a bulk job sends a model and reads back, from its config.

    Attributes:
        model: Model name.
        text_input: The input the texts go to (``TEXT``).
        pair_input: The input of the second texts (``TEXT_PAIR``), for a pair model.
        output: The output written (``EMBEDDING``, ``SCORES``).
        output_dims: Its dims per row, e.g. ``(384,)`` or ``(1,)``.
        output_type: Its Triton type, e.g. ``TYPE_FP32``.
        max_rows: The model's ``max_batch_size``: most rows per request.
        max_request_bytes: The model's ``max_request_bytes`` (the backend's default where unset).
        max_sequence_length: The model's ``max_sequence_length`` (where its config sets it): the
            tokens a row is truncated to, so rows longer than it cost the same.
        max_batch_tokens: The model's ``max_batch_tokens`` (where its config sets it): the most
            padded tokens of one forward pass.
        instances: The model's instances (``instance_group`` counts): requests it computes at once.
    """

    model: str
    text_input: str
    pair_input: str | None
    output: str
    output_dims: tuple[int, ...]
    output_type: str
    max_rows: int
    max_request_bytes: int
    max_sequence_length: int | None = None
    max_batch_tokens: int | None = None
    instances: int = 1

    @property
    def width(self) -> int:
        """Values per row."""
        return math.prod(self.output_dims)

    @property
    def scalar(self) -> bool:
        """Whether each row's output is a single value (a one-label classifier's score)."""
        return self.width == 1

    @property
    def column(self) -> str:
        """The output's column in the Parquet file: its name in lower case."""
        return self.output.lower()

    @property
    def dtype(self) -> np.dtype:
        """The output's numpy type."""
        return np.dtype(TRITON_DTYPES[self.output_type])


def model_io(config: Mapping[str, Any], *, output: str | None = None, pair: bool = False) -> ModelIO:
    """What to send ``config``'s model and what to read back (Triton's JSON config, as the server completed it).

    The texts go to ``TEXT`` (else the first string input), second texts to ``TEXT_PAIR``
    (else the second string input). The output is ``output``, or the model's only one.

    Raises:
        BatchJobError: The model does not take texts, takes a pair when none was given (or
            the reverse), has no such output, or an output of variable or non-numeric shape.
    """
    name = str(config.get("name", "?"))
    max_rows = int(config.get("max_batch_size", 0) or 0)
    if max_rows < 1:
        raise BatchJobError(f"model {name!r} has max_batch_size 0: a bulk job sends rows in batches")
    inputs = list(config.get("input", []))
    texts = [i["name"] for i in inputs if i.get("data_type") == "TYPE_STRING"]
    others = [f"{i['name']} ({i.get('data_type')})" for i in inputs
              if i.get("data_type") != "TYPE_STRING" and not i.get("optional", False)]
    if others or not texts:
        raise BatchJobError(f"model {name!r} takes {', '.join(others) or 'no text input'}: a bulk job sends texts "
                            "(call tensor models with tritonclient)")
    text_input = "TEXT" if "TEXT" in texts else texts[0]
    rest = [t for t in texts if t != text_input]
    pair_input = ("TEXT_PAIR" if "TEXT_PAIR" in rest else rest[0]) if rest else None
    if len(rest) > 1:
        raise BatchJobError(f"model {name!r} takes {len(texts)} texts per row; a bulk job sends one or two")
    if pair_input and not pair:
        raise BatchJobError(f"model {name!r} takes a text pair ({text_input}, {pair_input}): give the second "
                            "texts' column (--pair-column)")
    if pair and not pair_input:
        raise BatchJobError(f"model {name!r} takes one text ({text_input}): leave out the pair column")
    outputs = {o["name"]: o for o in config.get("output", [])}
    if output is None:
        if len(outputs) != 1:
            raise BatchJobError(f"model {name!r} has outputs {', '.join(outputs) or '(none)'}: name the one to "
                                "write (--output-name)")
        output = next(iter(outputs))
    if output not in outputs:
        raise BatchJobError(f"model {name!r} has no output {output!r} (it has {', '.join(outputs)})")
    spec = outputs[output]
    dims = tuple(int(d) for d in spec.get("dims", []))
    if not dims or any(d < 1 for d in dims):
        raise BatchJobError(f"output {output!r} of model {name!r} has dims {list(dims)}: a bulk job writes "
                            "fixed-size rows")
    kind = str(spec.get("data_type"))
    if kind not in TRITON_DTYPES:
        raise BatchJobError(f"output {output!r} of model {name!r} is {kind}: a bulk job writes numbers")
    parameters = config.get("parameters", {})

    def parameter(key: str) -> int | None:
        value = parameters.get(key, {}).get("string_value")
        return int(value) if value else None

    return ModelIO(model=name, text_input=text_input, pair_input=pair_input, output=output, output_dims=dims,
                   output_type=kind, max_rows=max_rows,
                   max_request_bytes=parameter("max_request_bytes") or DEFAULT_MAX_REQUEST_BYTES,
                   max_sequence_length=parameter("max_sequence_length"),
                   max_batch_tokens=parameter("max_batch_tokens"),
                   instances=max(1, sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1))


# --- planning and concurrency --------------------------------------------------------------------------------


_PIECE: Final = re.compile(r"\w+|[^\w\s]")
#: Rows counted at once by a tokenizer (bounds the memory of its encodings).
_TOKENIZER_BATCH: Final = 8192


def estimate_tokens(text: bytes) -> int:
    """A row's length for sorting without its tokenizer: its words and punctuation marks, plus two special tokens.

    WordPiece and BPE tokenizers split text at spaces and punctuation first, so this counts
    the pieces every row has at least; it sorts rows by token count far better than their
    bytes do (with the minilm tokenizer, 64-row runs of the queries workload pad 1.36x their
    real tokens sorted this way, 1.90x sorted by bytes, 1.04x by exact counts).
    """
    return len(_PIECE.findall(text.decode("utf-8"))) + 2


def row_lengths(texts: Sequence[bytes], pairs: Sequence[bytes] | None, *, tokenizer: Path | None = None,
                max_tokens: int | None = None) -> np.ndarray:
    """Each row's length in tokens (a pair's two texts together), capped at ``max_tokens`` (the model's truncation).

    Counted by ``tokenizer`` (a ``tokenizer.json``) where given, else estimated (``estimate_tokens``).
    """
    if tokenizer is None:
        lengths = np.array([estimate_tokens(t) for t in texts], dtype=np.int64)
        if pairs is not None:
            lengths += np.array([estimate_tokens(p) for p in pairs], dtype=np.int64)
    else:
        from tokenizers import Tokenizer

        counter = Tokenizer.from_file(str(tokenizer))
        # A tokenizer.json may carry padding and truncation of its own (the packaged MiniLM's pads to 128).
        counter.no_padding()
        if max_tokens:
            counter.enable_truncation(max_length=max_tokens, strategy="longest_first")
        else:
            counter.no_truncation()
        counts: list[int] = []
        for start in range(0, len(texts), _TOKENIZER_BATCH):
            chunk = [t.decode("utf-8") for t in texts[start:start + _TOKENIZER_BATCH]]
            batch: list[Any] = chunk
            if pairs is not None:
                batch = list(zip(chunk, [p.decode("utf-8") for p in pairs[start:start + _TOKENIZER_BATCH]],
                                 strict=True))
            # encode_batch_fast (tokenizers >= 0.21) skips the character offsets, which a count does not need.
            encode = getattr(counter, "encode_batch_fast", counter.encode_batch)
            encodings = encode(batch)
            counts.extend(len(e.ids) for e in encodings)
        lengths = np.array(counts, dtype=np.int64)
    return np.minimum(lengths, max_tokens) if max_tokens else lengths


def plan_requests(lengths: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray, *, max_rows: int,
                  max_bytes: int, max_tokens: int | None = None, seed: int | None = 0) -> list[np.ndarray]:
    """Row indices of each request: rows sorted by ``lengths``, cut into runs within every bound.

    ``lengths`` are the rows' tokens (the sort key), ``sizes`` their bytes. A request holds
    at most ``max_rows`` rows, ``max_bytes`` bytes and ``max_tokens`` padded tokens (rows x
    its longest row: one forward pass of the model's planner); a row over a bound alone goes
    alone (the server then says what is wrong with it).

    The requests are returned in a random order drawn from ``seed``, so that rows/s stays
    steady over a job rather than falling from the shortest rows to the longest, except that
    the cheapest tenth (by padded tokens) come last, in random order too: the job's last
    requests then finish close together instead of one long request keeping a server busy
    alone at the end. ``seed`` None: in length order.
    """
    if max_rows < 1 or max_bytes < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"max_rows, max_bytes and max_tokens must be at least 1, got {max_rows}, {max_bytes} "
                         f"and {max_tokens}")
    lengths = np.asarray(lengths, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    requests: list[np.ndarray] = []
    start, total = 0, 0
    for position, row in enumerate(order):
        size, rows = int(sizes[row]), position - start
        if rows and (rows >= max_rows or total + size > max_bytes
                     or (max_tokens is not None and (rows + 1) * int(lengths[row]) > max_tokens)):
            requests.append(order[start:position])
            start, total = position, 0
        total += size
    if start < len(order):
        requests.append(order[start:])
    if seed is None:
        return requests
    rng = random.Random(seed)
    cost = [len(r) * int(lengths[r[-1]]) for r in requests]  # padded tokens: the last row is the longest
    by_cost = sorted(range(len(requests)), key=lambda i: cost[i])
    tail = set(by_cost[:len(requests) // 10])
    body = [r for i, r in enumerate(requests) if i not in tail]
    end = [r for i, r in enumerate(requests) if i in tail]
    rng.shuffle(body)
    rng.shuffle(end)
    return body + end


class ConcurrencySearch:
    """Finds the number of requests in flight that gives the most work done per second, by measuring.

    Work is what the caller counts per answered request; a job counts padded tokens (rows x
    the request's longest row), so that a window of long rows and a window of short ones
    compare fairly. Hill-climbing: measure a window at the current concurrency, double it
    while a window gains at least ``gain`` over the best so far, then hold the best. While
    holding, every ``reprobe_windows`` windows it tries the next level up once more, so a
    server that got faster (a neighbour finished) is used. The first answers after a change
    were sent under the old concurrency and are not counted.

    Example:
        >>> search = ConcurrencySearch(start=2, maximum=16)
        >>> search.record(work=640, now=0.5)  # returns the concurrency to use from now on
        2
    """

    def __init__(self, start: int = 2, maximum: int = 32, *, gain: float = 1.05, window_s: float = 2.0,
                 min_requests: int = 4, reprobe_windows: int = 10) -> None:
        """A search from ``start`` requests in flight up to ``maximum``."""
        if not 1 <= start <= maximum:
            raise ValueError(f"need 1 <= start <= maximum, got start {start} and maximum {maximum}")
        if gain < 1 or window_s <= 0 or min_requests < 1 or reprobe_windows < 1:
            raise ValueError("gain must be >= 1, window_s > 0, min_requests and reprobe_windows >= 1")
        self.maximum, self.gain, self.window_s = maximum, gain, window_s
        self.min_requests, self.reprobe_windows = min_requests, reprobe_windows
        self.target = start
        self.best_target, self.best_rate = start, 0.0
        self.climbing = True
        self.history: list[tuple[int, float]] = []  # (concurrency, work/s) of every window
        self._held_windows = 0
        self._probing = False
        self._skip = 0
        self._window_start: float | None = None
        self._work = 0
        self._requests = 0

    def _change(self, target: int) -> None:
        self._skip = self.target if target != self.target else 0  # answers already in flight at the old level
        self.target = target
        self._window_start = None

    def record(self, work: int, now: float) -> int:
        """Count one answered request of ``work`` units at time ``now`` (seconds); returns the concurrency to use."""
        if self._skip > 0:
            self._skip -= 1
            if self._skip == 0:
                self._window_start = now
            return self.target
        if self._window_start is None:
            # The window opens at its first counted answer: the time before it was the pipeline filling.
            self._window_start, self._work, self._requests = now, 0, 0
            return self.target
        self._work += work
        self._requests += 1
        elapsed = now - self._window_start
        if elapsed < self.window_s or self._requests < max(self.min_requests, self.target):
            return self.target
        rate = self._work / elapsed
        self.history.append((self.target, rate))
        self._window_start, self._work, self._requests = now, 0, 0
        self._decide(rate)
        return self.target

    def _decide(self, rate: float) -> None:
        if self.climbing or self._probing:
            if rate >= self.best_rate * self.gain:
                self.best_target, self.best_rate = self.target, rate
                if self.target < self.maximum:
                    self._change(min(self.maximum, self.target * 2))
                    return
            self.climbing = self._probing = False
            self._held_windows = 0
            if self.target != self.best_target:
                self._change(self.best_target)
            return
        # Holding: the best level's rate follows the latest window, so a probe is compared with now, not then.
        self.best_rate = rate
        self._held_windows += 1
        if self._held_windows >= self.reprobe_windows and self.target < self.maximum:
            self._probing = True
            self._change(min(self.maximum, self.target * 2))

    def back_off(self) -> int:
        """Halve the concurrency after a server stopped answering; returns the new one."""
        self.climbing = self._probing = False
        self._held_windows = 0
        self.best_target = max(1, self.target // 2)
        self._change(self.best_target)
        return self.target


@dataclasses.dataclass(eq=False)  # endpoints are told apart by identity, not by their counts
class Endpoint:
    """One server of a job: its client, requests in flight, and until when it is left alone."""

    client: Any
    in_flight: int = 0
    down_until: float = 0.0
    requests: int = 0
    rows: int = 0
    failures: int = 0

    @property
    def url(self) -> str:
        """The server's ``host:port``."""
        return str(getattr(self.client, "url", self.client))


class EndpointPool:
    """Spreads requests over servers: the least busy one that is up, in turn among equals."""

    def __init__(self, clients: Sequence[Any], cooldown_s: float = 5.0) -> None:
        """One endpoint per client; a server that failed is left alone for ``cooldown_s``."""
        if not clients:
            raise ValueError("a job needs at least one server")
        self.endpoints = [Endpoint(c) for c in clients]
        self.cooldown_s = cooldown_s
        self._turn = 0

    def pick(self, now: float) -> Endpoint | None:
        """The endpoint for the next request, or None while every server is left alone."""
        count = len(self.endpoints)
        ring = [self.endpoints[(self._turn + i) % count] for i in range(count)]
        up = [e for e in ring if e.down_until <= now]
        if not up:
            return None
        chosen = min(up, key=lambda e: e.in_flight)  # min keeps the first of equals: the ring's turn
        self._turn = (self.endpoints.index(chosen) + 1) % count
        return chosen

    def fail(self, endpoint: Endpoint, now: float) -> None:
        """Leave ``endpoint`` alone for the cool-down."""
        endpoint.failures += 1
        endpoint.down_until = now + self.cooldown_s

    def next_up_s(self, now: float) -> float:
        """Seconds until some server may be tried again (0 if one is up)."""
        return max(0.0, min(e.down_until for e in self.endpoints) - now)


# --- writing and resuming ------------------------------------------------------------------------------------


def output_schema(io: ModelIO, id_column: str, id_kind: str) -> pa.Schema:
    """The output's columns: the ids (int64 or string), and the model's output (a value, or a fixed-size list)."""
    value = pa.from_numpy_dtype(io.dtype)
    field = pa.field(io.column, value if io.scalar else pa.list_(value, io.width))
    metadata = {"coalesce.model": io.model, "coalesce.output": io.output,
                "coalesce.output_dims": json.dumps(list(io.output_dims))}
    return pa.schema([pa.field(id_column, pa.int64() if id_kind == "integer" else pa.string()), field],
                     metadata=metadata)


def _parquet_options(schema: pa.Schema, compression: str) -> dict[str, Any]:
    """Parquet writer options: no dictionary (ids are unique, values distinct), statistics for the ids only.

    Measured on 4096 rows of 384 floats: 11 ms a write, against 43 with pyarrow's defaults,
    which try a dictionary and keep min/max for every value; the job writes on the cores the
    server computes on.
    """
    return {"compression": compression, "use_dictionary": False, "write_statistics": [schema.field(0).name]}


def _fsync_replace(temporary: Path, final: Path) -> None:
    with open(temporary, "rb") as stream:
        os.fsync(stream.fileno())
    os.replace(temporary, final)


class OutputFile:
    """The job's output, written as the job goes: the parts of earlier runs first, then each new part's rows.

    It is written to ``<output>.tmp`` and renamed into place only when the job is done, so
    the output exists only whole; a killed run's torn ``.tmp`` is written afresh by the next
    run, from the part files. Writing it along the way leaves nothing to merge at the end,
    when the server would stand idle.
    """

    def __init__(self, output: Path, schema: pa.Schema) -> None:
        """Open ``<output>.tmp`` for rows of ``schema``."""
        self.output, self.schema = output, schema
        self.temporary = output.with_name(output.name + ".tmp")
        # zstd: vectors of floats shrink by about a tenth (snappy, Parquet's default, gains nothing on them).
        self._writer = pq.ParquetWriter(self.temporary, schema, **_parquet_options(schema, "zstd"))
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        """Append ``table``'s rows."""
        if not table.schema.equals(self.schema):
            table = table.cast(self.schema)
        self._writer.write_table(table)
        self.rows += table.num_rows

    def copy_parts(self, directory: Path) -> int:
        """Append the rows of every part file in ``directory`` (an earlier run's); returns how many."""
        before = self.rows
        for part in part_files(directory):
            self.write(pq.ParquetFile(part).read())
        return self.rows - before

    def commit(self) -> None:
        """Finish the file and move it into place."""
        self._writer.close()
        _fsync_replace(self.temporary, self.output)

    def discard(self) -> None:
        """Close and remove the unfinished file (the part files keep the rows)."""
        self._writer.close()
        self.temporary.unlink(missing_ok=True)


class PartWriter:
    """Buffers answers and writes them as numbered Parquet part files, each whole or not at all.

    A part is written to a temporary name, synced and renamed, so a killed job leaves
    only complete parts behind. Each part's rows also go to ``sink``, the output file.
    """

    def __init__(self, directory: Path, schema: pa.Schema, *, part_rows: int, part_interval_s: float,
                 clock: Clock = time.monotonic, sink: OutputFile | None = None) -> None:
        """Write parts of ``schema`` into ``directory``, numbered after the ones there."""
        self.directory, self.schema, self.sink = directory, schema, sink
        self.part_rows, self.part_interval_s, self._clock = part_rows, part_interval_s, clock
        numbers = [int(p.stem[len(PART_PREFIX):]) for p in directory.glob(f"{PART_PREFIX}*.parquet")]
        self._next = max(numbers, default=0) + 1
        self._ids: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self.buffered = 0
        self.written = 0
        self._last = clock()

    def add(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Buffer the answers of one request: ids ``[n]`` and values ``[n, width]``; write a part when due."""
        self._ids.append(ids)
        self._values.append(values)
        self.buffered += len(ids)
        if self.buffered >= self.part_rows or self._clock() - self._last >= self.part_interval_s:
            self.flush()

    def due(self) -> bool:
        """Whether buffered answers have waited a part interval."""
        return self.buffered > 0 and self._clock() - self._last >= self.part_interval_s

    def flush(self) -> int:
        """Write the buffered answers as one part file; returns the rows written."""
        self._last = self._clock()
        if not self.buffered:
            return 0
        ids = np.concatenate(self._ids)
        values = np.concatenate(self._values)
        id_field, value_field = self.schema.field(0), self.schema.field(1)
        if pa.types.is_fixed_size_list(value_field.type):
            column: pa.Array = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)),
                                                                 value_field.type.list_size)
        else:
            column = pa.array(values.reshape(-1), type=value_field.type)
        table = pa.Table.from_arrays([pa.array(ids.tolist(), type=id_field.type), column], schema=self.schema)
        final = self.directory / f"{PART_PREFIX}{self._next:06d}.parquet"
        temporary = final.with_suffix(".tmp")
        pq.write_table(table, temporary, **_parquet_options(self.schema, "none"))  # parts are read once, if ever
        _fsync_replace(temporary, final)
        if self.sink is not None:
            self.sink.write(table)
        self._next += 1
        self._ids, self._values = [], []
        rows, self.buffered = self.buffered, 0
        self.written += rows
        return rows


def part_files(directory: Path) -> list[Path]:
    """The job's complete part files, in the order they were written."""
    return sorted(directory.glob(f"{PART_PREFIX}*.parquet"))


def finished_ids(directory: Path, id_column: str) -> set[Id]:
    """The ids already in the part files of ``directory`` (a killed run's leftovers, ``*.tmp``, are removed).

    Raises:
        BatchJobError: An id is in two parts (the folder was changed by hand, or by another job).
    """
    for leftover in directory.glob(f"{PART_PREFIX}*.tmp"):
        leftover.unlink()
    done: set[Id] = set()
    count = 0
    for part in part_files(directory):
        ids = pq.ParquetFile(part).read(columns=[id_column]).column(0).to_pylist()
        count += len(ids)
        done.update(ids)
    if len(done) != count:
        raise BatchJobError(f"{directory} holds {count - len(done)} ids twice: its parts are not one job's; "
                            "remove the folder or pass --restart")
    return done


def job_state(options: BatchOptions, io: ModelIO) -> dict[str, Any]:
    """What makes two runs the same job: the input file as it was, the columns, the model and its output."""
    stat = options.input_path.stat()
    return {"version": STATE_VERSION, "input": str(options.input_path.resolve()), "input_bytes": stat.st_size,
            "input_mtime_ns": stat.st_mtime_ns, "format": options.format, "id_column": options.id_column,
            "text_column": options.text_column, "pair_column": options.pair_column, "model": io.model,
            "output": io.output, "output_dims": list(io.output_dims), "output_type": io.output_type}


def open_work_dir(options: BatchOptions, state: Mapping[str, Any]) -> bool:
    """Prepare the working folder for ``state``; returns whether it holds an earlier run of the same job.

    Raises:
        BatchJobError: The folder holds another job's parts, or the output exists without them.
    """
    directory = options.parts
    saved_path = directory / STATE_FILE
    if options.restart and directory.exists():
        shutil.rmtree(directory)
    if saved_path.is_file():
        saved = json.loads(saved_path.read_text())
        differs = [key for key in state if saved.get(key) != state[key]]
        if differs:
            detail = ", ".join(f"{key} {saved.get(key)!r} then, {state[key]!r} now" for key in differs)
            raise BatchJobError(f"{directory} holds the parts of another job ({detail}): pass --restart to "
                                "start over, or give another output")
        return True
    if options.output_path.exists() and not options.restart:
        raise BatchJobError(f"{options.output_path} exists: pass --restart to compute it again, or give another "
                            "output")
    directory.mkdir(parents=True, exist_ok=True)
    options.output_path.parent.mkdir(parents=True, exist_ok=True)
    temporary = saved_path.with_suffix(".tmp")
    temporary.write_text(json.dumps(dict(state), indent=1) + "\n")
    _fsync_replace(temporary, saved_path)
    return False


def read_server_rejects(directory: Path) -> list[Reject]:
    """Rows the server refused in earlier runs of the job (a killed run's torn last line is ignored)."""
    path = directory / SERVER_REJECTS_FILE
    rejects: list[Reject] = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
                record = json.loads(line)
                rejects.append(Reject(int(record["line"]), str(record["reason"]), str(record["raw"]), record["id"]))
    return rejects


# --- the job -------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BatchReport:
    """What one run of a job did.

    Attributes:
        output: The merged Parquet file.
        rejects: The rejects file.
        rows: Valid rows in the input.
        rejected: Rows rejected: malformed in the input, or refused by the server (all runs).
        skipped: Rows already finished by an earlier run, not sent.
        sent: Rows this run sent (each once, however many times its request was split or retried).
        written: Rows this run wrote.
        output_rows: Rows of the merged output.
        requests: Requests this run sent (split and retried ones included).
        concurrency: Requests in flight at the end.
        concurrency_history: ``(concurrency, padded tokens/s)`` of every window the search measured.
        read_s: Seconds reading the input.
        send_s: Seconds from the first request to the last answer written.
        merge_s: Seconds spent on the output file outside the sending: copying an earlier run's
            parts in, and finishing it at the end.
        wall_s: Seconds of the whole run.
        servers: Per server: requests, rows and failures.
    """

    output: str
    rejects: str
    rows: int
    rejected: int
    skipped: int
    sent: int
    written: int
    output_rows: int
    requests: int
    concurrency: int
    concurrency_history: list[tuple[int, float]]
    read_s: float
    send_s: float
    merge_s: float
    wall_s: float
    servers: list[dict[str, Any]]

    @property
    def rows_per_s(self) -> float:
        """Rows this run wrote per second of its whole run (reading and merging included)."""
        return self.written / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, with rows/s."""
        return {**dataclasses.asdict(self), "rows_per_s": round(self.rows_per_s, 2),
                "concurrency_history": [[c, round(r, 2)] for c, r in self.concurrency_history]}


def discover(clients: Sequence[EmbeddingClient], options: BatchOptions,
             log: Callable[[str], None]) -> tuple[ModelIO, list[EmbeddingClient]]:
    """The model's I/O, read from every server's config; the servers that answered, in order.

    Raises:
        BatchJobError: No server answered, or two servers serve the model differently.
        ClientError: The model is unknown or access is denied.
    """
    found: ModelIO | None = None
    answered: list[EmbeddingClient] = []
    last: ClientError | None = None
    for client in clients:
        try:
            config = client.model_config()
        except (ServerUnavailableError, RequestTimeoutError) as exc:
            log(f"coalesce-client: {client.url} does not answer ({type(exc).__name__}); going on without it")
            last = exc
            continue
        io = model_io(config, output=options.output_name, pair=options.pair_column is not None)
        if found is not None and io != found:
            raise BatchJobError(f"{client.url} serves {client.model!r} differently from {answered[0].url}: "
                                f"{io} against {found}")
        found = io
        answered.append(client)
    if found is None:
        raise BatchJobError(f"no server answered: {last}")
    return found, answered


class _Progress:
    """A tqdm bar on standard error (rows, rows/s, ETA), or nothing."""

    def __init__(self, enabled: bool, total: int, initial: int) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="row", dynamic_ncols=True,
                            smoothing=0.05, file=sys.stderr, desc="batch")

    def update(self, rows: int, concurrency: int) -> None:
        if self.bar is not None:
            self.bar.update(rows)
            self.bar.set_postfix_str(f"c={concurrency}", refresh=False)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            sys.stderr.write(line + "\n")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Rejects:
    """The rejects file of this run, the server's refusals kept in the working folder too, and their messages."""

    def __init__(self, path: Path, directory: Path, noun: str, log: Callable[[str], None]) -> None:
        self.path, self.noun, self._log = path, noun, log
        path.parent.mkdir(parents=True, exist_ok=True)
        self._stream = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._server = open(directory / SERVER_REJECTS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self.count = 0

    def add(self, reject: Reject, *, from_server: bool = False) -> None:
        line = json.dumps(reject.as_dict(), ensure_ascii=False) + "\n"
        self._stream.write(line)
        if from_server:
            self._server.write(line)
            self._server.flush()
        self.count += 1
        if self.count <= MAX_REJECT_MESSAGES:
            self._log(f"coalesce-client: {reject.message(self.noun)}")

    def close(self) -> None:
        if self.count > MAX_REJECT_MESSAGES:
            self._log(f"coalesce-client: {self.count - MAX_REJECT_MESSAGES} more rejected rows in {self.path}")
        self._stream.close()
        self._server.close()


def _object_column(values: Sequence[bytes]) -> np.ndarray:
    array = np.empty(len(values), dtype=np.object_)
    array[:] = values
    return array


class _Sender:
    """The sending loop of one run: requests out to the servers, answers into part files, failures handled.

    Only the calling thread touches the job's state; worker threads only send.
    """

    def __init__(self, options: BatchOptions, io: ModelIO, rows: InputRows, pool: EndpointPool,
                 writer: PartWriter, rejects: _Rejects, progress: _Progress, say: Callable[[str], None],
                 clock: Clock) -> None:
        self.options, self.io, self.rows, self.pool = options, io, rows, pool
        self.writer, self.rejects, self.progress, self.say, self.clock = writer, rejects, progress, say, clock
        self.ids = np.array(rows.ids, dtype=object)
        self.texts = _object_column(rows.texts)
        self.pairs = _object_column(rows.pairs) if rows.pairs is not None else None
        self.lengths = np.zeros(len(rows), dtype=np.int64)  # tokens of each row to send (counted or estimated)
        # Two requests per instance: one computing, one queued behind it, so no instance waits for the client.
        start = min(options.max_concurrency, options.concurrency or 2 * io.instances * len(pool.endpoints))
        self.search = None if options.concurrency else ConcurrencySearch(start=start,
                                                                         maximum=options.max_concurrency)
        self.target = start
        self.queue: deque[np.ndarray] = deque()
        self.pending: dict[Future[dict[str, np.ndarray]], tuple[Endpoint, np.ndarray]] = {}
        self.failures: dict[int, int] = {}  # id(chunk) -> failed attempts of that request
        self.max_failures = 2 * len(pool.endpoints) + 1
        self.fatal: BaseException | None = None
        self.requests = 0

    def run(self, todo: np.ndarray) -> None:
        """Send rows ``todo`` (indices into the input's rows) until each is written or rejected, or a fatal error.

        Raises:
            BatchJobError: The job stopped; the answers that came back are written.
        """
        texts = [self.rows.texts[i] for i in todo]
        pairs = [self.rows.pairs[i] for i in todo] if self.rows.pairs is not None else None
        lengths = row_lengths(texts, pairs, tokenizer=self.options.tokenizer,
                              max_tokens=self.io.max_sequence_length)
        self.lengths[todo] = lengths
        sizes = np.array([len(t) for t in texts], dtype=np.int64)
        if pairs is not None:
            sizes += np.array([len(p) for p in pairs], dtype=np.int64)
        max_rows = min(self.options.rows_per_request or self.io.max_rows, self.io.max_rows)
        max_bytes = self.options.max_request_bytes or self.io.max_request_bytes
        plan = plan_requests(lengths, sizes, max_rows=max_rows, max_bytes=max_bytes,
                             max_tokens=self.io.max_batch_tokens, seed=self.options.seed)
        self.queue.extend(todo[chunk] for chunk in plan)
        executor = ThreadPoolExecutor(max_workers=self.options.max_concurrency, thread_name_prefix="coalesce-batch")
        drained = False
        try:
            while (self.queue and self.fatal is None) or self.pending:
                self._submit(executor)
                if not self.pending:
                    time.sleep(min(1.0, max(0.01, self.pool.next_up_s(self.clock()))))
                    continue
                finished, _ = wait(self.pending, timeout=0.5, return_when=FIRST_COMPLETED)
                answered = [(future, *self.pending.pop(future)) for future in finished]
                for _, endpoint, _ in answered:
                    endpoint.in_flight -= 1
                # Keep the servers fed first: an instance whose answer came back waits for its next request
                # while this thread writes parts and counts.
                self._submit(executor)
                for future, endpoint, chunk in answered:
                    self._answered(future, endpoint, chunk)
                if self.writer.due():
                    self.writer.flush()
            drained = True
        finally:
            # Keep every answer that came back, whatever stopped the job (an error, Ctrl-C); on Ctrl-C do not
            # wait for the requests in flight.
            self.writer.flush()
            executor.shutdown(wait=drained, cancel_futures=True)
        if self.fatal is not None:
            where = f"{self.writer.written} rows of this run are kept in {self.options.parts}: run the job again " \
                    "to resume"
            if isinstance(self.fatal, BatchJobError):
                raise BatchJobError(f"{self.fatal}; {where}") from self.fatal
            if isinstance(self.fatal, ClientError):
                raise BatchJobError(f"{type(self.fatal).__name__}: {self.fatal}; {where}") from self.fatal
            raise self.fatal

    def _send(self, endpoint: Endpoint, chunk: np.ndarray) -> dict[str, np.ndarray]:
        inputs = {self.io.text_input: self.texts[chunk].reshape(-1, 1)}
        if self.io.pair_input is not None and self.pairs is not None:
            inputs[self.io.pair_input] = self.pairs[chunk].reshape(-1, 1)
        return dict(endpoint.client.infer(inputs, [self.io.output]))

    def _submit(self, executor: ThreadPoolExecutor) -> None:
        now = self.clock()
        while self.queue and self.fatal is None and len(self.pending) < self.target:
            endpoint = self.pool.pick(now)
            if endpoint is None:
                return
            chunk = self.queue.popleft()
            endpoint.in_flight += 1
            self.requests += 1
            self.pending[executor.submit(self._send, endpoint, chunk)] = (endpoint, chunk)

    def _answered(self, future: Future[dict[str, np.ndarray]], endpoint: Endpoint, chunk: np.ndarray) -> None:
        try:
            answer = future.result()
        except InvalidInputError as error:
            self._refused(chunk, error)
            return
        except (ServerUnavailableError, RequestTimeoutError, ServerError, ModelNotFoundError) as error:
            # One server's trouble (gone, overloaded, its model failing or unloaded): the others may serve.
            self._unavailable(endpoint, chunk, error)
            return
        except Exception as error:  # access denied, or a bug: stop, keeping the work done
            self.fatal = self.fatal or error
            return
        values = np.asarray(answer[self.io.output])
        if values.shape[0] != len(chunk) or values.size != len(chunk) * self.io.width:
            self.fatal = BatchJobError(f"{endpoint.url} answered {self.io.output} of shape {values.shape} for "
                                       f"{len(chunk)} rows of {list(self.io.output_dims)}")
            return
        self.failures.pop(id(chunk), None)
        endpoint.requests += 1
        endpoint.rows += len(chunk)
        self.writer.add(self.ids[chunk], values.reshape(len(chunk), self.io.width).astype(self.io.dtype, copy=False))
        if self.search is not None:  # work: the request's padded tokens
            self.target = self.search.record(len(chunk) * int(self.lengths[chunk].max()), self.clock())
        self.progress.update(len(chunk), self.target)

    def _refused(self, chunk: np.ndarray, error: ClientError) -> None:
        """The server refused a request's input: split it until the refused rows stand alone, then reject them."""
        if len(chunk) > 1:
            half = len(chunk) // 2
            self.queue.extendleft([chunk[half:], chunk[:half]])
            return
        row = int(chunk[0])
        record = {self.options.id_column: self.rows.ids[row], self.options.text_column: self.rows.texts[row].decode()}
        if self.rows.pairs is not None and self.options.pair_column:
            record[self.options.pair_column] = self.rows.pairs[row].decode()
        self.rejects.add(Reject(self.rows.lines[row], f"refused by the server: {error}",
                                _raw(json.dumps(record, ensure_ascii=False)), self.rows.ids[row]), from_server=True)
        self.progress.update(1, self.target)

    def _unavailable(self, endpoint: Endpoint, chunk: np.ndarray, error: ClientError) -> None:
        """A server failed a request (after its retries): leave it alone a while; the request goes elsewhere.

        Sending a request again is safe: inference is idempotent. A request that failed
        ``max_failures`` times (on every server, or the same one again) stops the job.
        """
        self.pool.fail(endpoint, self.clock())
        tries = self.failures[id(chunk)] = self.failures.get(id(chunk), 0) + 1
        self.say(f"coalesce-client: {endpoint.url}: {type(error).__name__}: {error}; its request goes to another "
                 f"server or waits {self.pool.cooldown_s:g} s")
        if tries >= self.max_failures:
            self.fatal = BatchJobError(f"a request failed {tries} times, on every server: {error}")
            return
        self.queue.appendleft(chunk)
        # A refusal or a timeout says the servers are overloaded; a server that is gone does not.
        if self.search is not None and isinstance(error, RequestRejectedError | RequestTimeoutError):
            self.target = self.search.back_off()


def run_batch(options: BatchOptions, clients: Sequence[EmbeddingClient], *,
              log: Callable[[str], None] | None = None, clock: Clock = time.monotonic) -> BatchReport:
    """Run (or resume) a bulk job over ``clients`` (one per server, the same model); returns what it did.

    Args:
        options: The job.
        clients: One client per server; their model, protocol, deadline and retries are used.
        log: Where messages go (default: standard error, beside the progress bar).
        clock: Monotonic seconds.

    Raises:
        BatchJobError: The job cannot start, or stopped (no server answered, the model or
            the server failed); what was finished is kept, and running it again resumes.
        ClientError: The model is unknown or access is denied (found before anything is sent).
    """
    started = clock()
    progress = _Progress(False, 0, 0)

    def say(line: str) -> None:
        (log or progress.write)(line)  # beside the progress bar once there is one

    io, clients = discover(clients, options, say)
    rows = read_input(options)
    read_s = clock() - started
    id_kind = "integer" if rows.ids and isinstance(rows.ids[0], int) else "string"
    if not rows.ids and options.format == "parquet":
        id_kind = "integer" if pa.types.is_integer(pq.read_schema(options.input_path).field(
            options.id_column).type) else "string"
    schema = output_schema(io, options.id_column, id_kind)
    resumed = open_work_dir(options, {**job_state(options, io), "id_kind": id_kind})
    directory = options.parts
    done = finished_ids(directory, options.id_column) if resumed else set()
    earlier_rejects = read_server_rejects(directory) if resumed else []
    refused = {r.id for r in earlier_rejects}
    todo = np.array([i for i, row_id in enumerate(rows.ids) if row_id not in done and row_id not in refused],
                    dtype=np.int64)
    skipped = len(rows) - len(todo)
    if resumed:
        say(f"coalesce-client: resuming {options.output_path}: {len(done)} rows finished and {len(refused)} "
            f"refused earlier, {len(todo)} to send")
    progress = _Progress(options.progress, total=len(rows), initial=skipped)
    rejects = _Rejects(options.rejects, directory, rows.noun, say)
    pool = EndpointPool(clients, cooldown_s=options.cooldown_s)
    output = OutputFile(options.output_path, schema)
    committed = False
    try:
        merge_started = clock()
        output.copy_parts(directory)
        merge_s = clock() - merge_started
        writer = PartWriter(directory, schema, part_rows=options.part_rows, part_interval_s=options.part_interval_s,
                            clock=clock, sink=output)
        sender = _Sender(options, io, rows, pool, writer, rejects, progress, say, clock)
        send_started = clock()
        try:
            for reject in [*rows.rejects, *earlier_rejects]:
                rejects.add(reject)
            sender.run(todo)
        finally:
            progress.close()
            rejects.close()
        send_s = clock() - send_started
        finish_started = clock()
        expected = len(rows) - len({r.id for r in read_server_rejects(directory)})
        if output.rows != expected:
            raise BatchJobError(f"{directory} holds {output.rows} rows, the job {expected}: its parts were changed; "
                                "pass --restart")
        output.commit()
        committed = True
    finally:
        if not committed:
            output.discard()
    if not options.keep_parts:
        shutil.rmtree(directory)
    merge_s += clock() - finish_started
    return BatchReport(output=str(options.output_path), rejects=str(options.rejects), rows=len(rows),
                       rejected=rejects.count, skipped=skipped, sent=len(todo), written=writer.written,
                       output_rows=output.rows, requests=sender.requests, concurrency=sender.target,
                       concurrency_history=list(sender.search.history) if sender.search else [], read_s=read_s,
                       send_s=send_s, merge_s=merge_s, wall_s=clock() - started,
                       servers=[{"url": e.url, "requests": e.requests, "rows": e.rows, "failures": e.failures}
                                for e in pool.endpoints])
