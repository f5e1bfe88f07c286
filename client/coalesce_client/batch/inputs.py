"""Reading a job's input: JSONL, CSV or Parquet rows of an id and a text (and a pair).

Each bad row becomes a reject with its line number and reason; the rest of the file goes on.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Final

import pyarrow as pa
import pyarrow.parquet as pq

from coalesce_client.batch.options import BatchOptions, Id
from coalesce_client.errors import (
    BatchJobError,
)

#: Most characters of a raw line kept in a reject record (a bad line may be huge).
RAW_CHARS: Final = 4096


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


#: A column the row does not have (``None`` is a null, which a row may also hold).
MISSING: Final = object()


def json_kind(value: object) -> str:
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


def clip_raw(text: str) -> str:
    """``text`` cut to ``RAW_CHARS``, with bytes that were not UTF-8 (surrogates) written as escapes."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= RAW_CHARS else text[:RAW_CHARS] + f"... ({len(text)} characters)"


class RowChecker:
    """Checks rows one by one and keeps the valid ones; every reason names the column and what it holds."""

    def __init__(self, id_column: str, text_column: str, pair_column: str | None) -> None:
        """Check rows of ``id_column`` and ``text_column`` (and ``pair_column``); ``rows`` holds the result."""
        self.id_column, self.text_column, self.pair_column = id_column, text_column, pair_column
        self.rows = InputRows(ids=[], texts=[], pairs=[] if pair_column else None, lines=[], rejects=[])
        self._first_line: dict[Id, int] = {}
        self._id_kind: str | None = None

    def reject(self, line: int, reason: str, raw: str, row_id: Id | None = None) -> None:
        """Leave the row on ``line`` out, for ``reason``."""
        self.rows.rejects.append(Reject(line, reason, clip_raw(raw), row_id))

    def _text(self, column: str, value: object) -> bytes | str:
        """The text as UTF-8, or the reason it is not one."""
        if value is MISSING:
            return f"missing {column!r}"
        if not isinstance(value, str):
            return f"{column!r} must be a string, got {json_kind(value)}"
        if not value:
            return f"{column!r} is empty"
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:
            return f"{column!r} is not valid UTF-8"

    def add(self, line: int, raw: str, row_id: object, text: object, pair: object = MISSING) -> None:
        """Keep the row if its id and texts are usable (``MISSING`` for a column it lacks), else reject it."""
        if row_id is MISSING or row_id is None:
            self.reject(line, f"missing {self.id_column!r}" if row_id is MISSING else f"{self.id_column!r} is null",
                        raw)
            return
        if isinstance(row_id, bool) or not isinstance(row_id, int | str):
            self.reject(line, f"{self.id_column!r} must be a string or an integer, got {json_kind(row_id)}", raw)
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
            self.reject(line, f"{self.id_column!r} {row_id!r} is {json_kind(row_id)}, but the ids before it are "
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
    rows = RowChecker(id_column, text_column, pair_column)
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
                rows.reject(number, f"expected a JSON object, got {json_kind(record)}", raw)
                continue
            rows.add(number, raw, record.get(id_column, MISSING), record.get(text_column, MISSING),
                     record.get(pair_column, MISSING) if pair_column else MISSING)
    return rows.rows


def read_csv(path: Path, id_column: str = "id", text_column: str = "text",
             pair_column: str | None = None) -> InputRows:
    """Rows of a CSV file with a header line; ids are read as strings. A quoted field may span lines.

    Raises:
        BatchJobError: The header lacks a column the job needs.
    """
    rows = RowChecker(id_column, text_column, pair_column)
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
                rows.add(line, raw, row_id if row_id != "" else MISSING, fields[where[text_column]],
                         fields[where[pair_column]] if pair_column else MISSING)
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
    rows = RowChecker(id_column, text_column, pair_column)
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
                     record[pair_column] if pair_column else MISSING)
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


