"""The Ray engine: a job's rows read, sent and written by Ray Data actors, for corpora beyond one machine.

``coalesce-client batch --engine ray [--ray-address HEAD:PORT]`` reads the input with
``ray.data`` (Parquet and CSV by Arrow, JSONL line by line so that a bad line is one reject),
and ``map_batches`` hands each batch of ``ray_batch_rows`` rows to an actor
(``coalesce_client.ray``), which sorts it by length, sends it in requests of the model's row
limit and writes it as one part file. Ray schedules the actors over the cluster's nodes, and
restarts an actor and retries its batch when a node dies.

Exactly once: a part file is named by a hash of its batch's rows and written whole (a temporary
name, then a rename), so a retried batch replaces its own file instead of adding a second copy.
A rerun skips the ids already in the part files (and the rows rejected before). At the end the
driver merges the parts into the output (the same columns as the local engine's) and every
batch's rejects into the rejects file; an id found twice there (which the naming rules out
unless the input holds it twice) is kept once and said.

The working folder must be one every node can write (on one machine: any folder; on a cluster:
a shared file system).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.parquet as pq

from coalesce_client.batch.inputs import MISSING, clip_raw
from coalesce_client.batch.model import ModelIO, discover
from coalesce_client.batch.options import BatchOptions, Clock
from coalesce_client.batch.outputs import PART_PREFIX, OutputFile, fsync_replace, output_schema, part_files
from coalesce_client.batch.report import MAX_REJECT_MESSAGES, BatchReport
from coalesce_client.batch.state import job_state, open_work_dir
from coalesce_client.client import EmbeddingClient
from coalesce_client.errors import BatchJobError
from coalesce_client.ray import ERROR_COLUMN, NODE, RowModel, resolve_urls

#: Rejects of one batch, beside its part file.
REJECTS_PREFIX: Final = "rejects-"
#: The column of a JSONL line's own error (bad JSON, a mistyped id), and of its raw text.
INPUT_ERROR_COLUMN: Final = "_coalesce_input_error"
RAW_COLUMN: Final = "_coalesce_raw"
#: Ray CPUs an actor asks for.
ACTOR_CPUS: Final = 0.25


def batch_name(ids: Sequence[Any], raws: Sequence[str]) -> str:
    """A batch's file name stem: a hash of its rows (the same rows, the same name, whichever actor or try)."""
    digest = hashlib.blake2b(digest_size=12)
    for row_id, raw in zip(ids, raws, strict=True):
        digest.update(repr(row_id).encode("utf-8", "backslashreplace") + b"\x00" + raw.encode("utf-8", "replace"))
        digest.update(b"\x01")
    return digest.hexdigest()


def _write_whole(path: Path, write: Callable[[Path], Any]) -> None:
    temporary = path.with_name(path.name + f".{os.getpid()}.tmp")
    write(temporary)
    fsync_replace(temporary, path)


class PartWritingModel(RowModel):
    """The job's actor: a batch's outputs into a part file, its rejects beside it; returns the counts."""

    def __init__(self, urls: Sequence[str], model: str, *, directory: str, schema: pa.Schema, **kwargs: Any) -> None:
        """As ``RowModel``, writing into ``directory`` rows of ``schema`` (id, output)."""
        super().__init__(urls, model, **kwargs)
        self.directory, self.schema = Path(directory), schema

    def __call__(self, batch: pa.Table | Any) -> pa.Table:
        """Compute, write the part and its rejects, return ``rows`` and ``rejected`` of the batch."""
        table = batch if isinstance(batch, pa.Table) else pa.table(dict(batch))
        raws = (table.column(RAW_COLUMN).to_pylist() if RAW_COLUMN in table.column_names
                else [""] * table.num_rows)
        name = batch_name(table.column(self.id_column).to_pylist(), raws)
        rejects: list[dict[str, Any]] = []
        if INPUT_ERROR_COLUMN in table.column_names:
            input_errors = table.column(INPUT_ERROR_COLUMN)
            bad = table.filter(input_errors.is_valid())
            for row_id, reason, raw in zip(bad.column(self.id_column).to_pylist(),
                                           bad.column(INPUT_ERROR_COLUMN).to_pylist(),
                                           bad.column(RAW_COLUMN).to_pylist(), strict=True):
                rejects.append({"id": row_id, "reason": reason, "raw": raw})
            table = table.filter(input_errors.is_null())
        answered = super().__call__(table.select([c for c in table.column_names
                                                  if c not in (INPUT_ERROR_COLUMN, RAW_COLUMN)]))
        errors = answered.column(ERROR_COLUMN)
        failed = answered.filter(errors.is_valid())
        for row in failed.to_pylist():
            record = {self.id_column: row[self.id_column], self.text_column: row[self.text_column]}
            if self.pair_column:
                record[self.pair_column] = row[self.pair_column]
            rejects.append({"id": row[self.id_column] if isinstance(row[self.id_column], int | str) else None,
                            "reason": row[ERROR_COLUMN],
                            "raw": clip_raw(json.dumps(record, ensure_ascii=False, default=str))})
        done = answered.filter(errors.is_null()).select([self.id_column, self.output_column])
        done = done.rename_columns(self.schema.names).cast(self.schema)
        if done.num_rows:
            _write_whole(self.directory / f"{PART_PREFIX}{name}.parquet",
                         lambda path: pq.write_table(done, path, compression="none", use_dictionary=False))
        if rejects:
            text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rejects)
            _write_whole(self.directory / f"{REJECTS_PREFIX}{name}.jsonl",
                         lambda path: path.write_text(text, encoding="utf-8"))
        return pa.table({"rows": [done.num_rows], "rejected": [len(rejects)]})


def parse_jsonl(batch: Any, *, id_column: str, text_column: str, pair_column: str | None,
                id_kind: str) -> pa.Table:
    """JSONL lines (``ray.data.read_text``'s ``text`` column) as rows; a line that is not a row keeps its reason."""
    ids: list[Any] = []
    texts: list[str | None] = []
    pairs: list[str | None] = []
    errors: list[str | None] = []
    raws: list[str] = []
    for line in batch["text"]:
        line = str(line)
        error: str | None = None
        row_id: Any = None
        text: Any = None
        pair: Any = None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            record, error = None, f"invalid JSON: {exc.msg} (column {exc.colno})"
        if record is not None and not isinstance(record, dict):
            error = "expected a JSON object"
        elif isinstance(record, dict):
            row_id = record.get(id_column, MISSING)
            text, pair = record.get(text_column), record.get(pair_column) if pair_column else None
            wanted = int if id_kind == "integer" else str
            if row_id is MISSING or row_id is None:
                error, row_id = f"missing {id_column!r}" if row_id is MISSING else f"{id_column!r} is null", None
            elif isinstance(row_id, bool) or not isinstance(row_id, wanted):
                error, row_id = (f"{id_column!r} must be {'an integer' if wanted is int else 'a string'} like the "
                                 "first row's"), None
            elif not isinstance(text, str) or (pair_column and not isinstance(pair, str)):
                column = text_column if not isinstance(text, str) else pair_column
                error = f"{column!r} must be a string"
        if error is not None:
            text = pair = None
        ids.append(row_id)
        texts.append(text)
        pairs.append(pair)
        errors.append(error)
        raws.append(clip_raw(line))
    columns: dict[str, pa.Array] = {
        id_column: pa.array(ids, type=pa.int64() if id_kind == "integer" else pa.string()),
        text_column: pa.array(texts, type=pa.string())}
    if pair_column:
        columns[pair_column] = pa.array(pairs, type=pa.string())
    columns[INPUT_ERROR_COLUMN] = pa.array(errors, type=pa.string())
    columns[RAW_COLUMN] = pa.array(raws, type=pa.string())
    return pa.table(columns)


def unfinished(batch: pa.Table, *, id_column: str, done: Any) -> pa.Table:
    """The rows of ``batch`` whose id is not in ``done`` (a set, or an object reference to one)."""
    import ray

    finished = ray.get(done) if isinstance(done, ray.ObjectRef) else done
    keep = [row_id not in finished for row_id in batch.column(id_column).to_pylist()]
    return batch.filter(pa.array(keep, type=pa.bool_()))


def _first_id_kind(options: BatchOptions) -> str:
    """``integer`` or ``string``: the kind of the ids (the first JSONL row's, a column's type otherwise)."""
    if options.format == "csv":
        return "string"
    if options.format == "parquet":
        kind = pq.read_schema(options.input_path).field(options.id_column).type
        return "integer" if pa.types.is_integer(kind) else "string"
    with open(options.input_path, encoding="utf-8", errors="replace") as stream:
        for line in stream:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get(options.id_column), int | str) \
                    and not isinstance(record.get(options.id_column), bool):
                return "integer" if isinstance(record[options.id_column], int) else "string"
    return "string"


def _read(options: BatchOptions, id_kind: str) -> Any:
    """The input as a Ray dataset of rows (and, for JSONL, each line's own error and raw text)."""
    import pyarrow.csv as pacsv
    import ray.data

    path = str(options.input_path)
    columns = [c for c in (options.id_column, options.text_column, options.pair_column) if c]
    if options.format == "parquet":
        return ray.data.read_parquet(path, columns=columns)
    if options.format == "csv":
        types = {c: pa.string() for c in columns}
        return ray.data.read_csv(path, convert_options=pacsv.ConvertOptions(column_types=types,
                                                                            include_columns=columns))
    dataset = ray.data.read_text(path, drop_empty_lines=True)
    parse = functools.partial(parse_jsonl, id_column=options.id_column, text_column=options.text_column,
                              pair_column=options.pair_column, id_kind=id_kind)
    return dataset.map_batches(parse, batch_format="numpy", batch_size=options.ray_batch_rows)


def finished(directory: Path, id_column: str) -> tuple[set[Any], set[Any]]:
    """The ids in the part files of ``directory`` (torn ``*.tmp`` files removed), and the ids rejected before."""
    for leftover in directory.glob("*.tmp"):
        leftover.unlink()
    done: set[Any] = set()
    for part in part_files(directory):
        done.update(pq.ParquetFile(part).read(columns=[id_column]).column(0).to_pylist())
    rejected = {r["id"] for r in _rejects(directory) if r.get("id") is not None}
    return done, rejected


def _rejects(directory: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    for path in sorted(directory.glob(f"{REJECTS_PREFIX}*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line not in seen:
                seen.add(line)
                records.append(json.loads(line))
    return records


def _client_settings(clients: Sequence[EmbeddingClient]) -> dict[str, Any]:
    """What each actor's client needs to be the CLI's client again, on another machine."""
    first = clients[0]
    return {"model": first.model, "protocol": first.protocol, "timeout_s": first.timeout_s,
            "max_attempts": first.retry.max_attempts, "headers": dict(first.headers or {}) or None, "tls": first.tls}


@contextlib.contextmanager
def ray_session(options: BatchOptions) -> Iterator[None]:
    """Ray for a job: connected (or a local instance started) unless it already is, and let go after if started here.

    Several jobs of one process (an OpenAI file's row jobs) share one session: Ray started again in
    the same process after a shutdown may not come up. Inside, standard output is standard error:
    Ray prints what its workers and raylets say (a retried task, a dead node) on standard output,
    which holds the job's JSON report.

    Raises:
        BatchJobError: Ray is not installed.
    """
    try:
        import ray
    except ImportError:
        raise BatchJobError('--engine ray needs Ray: pip install "coalesce[ray]"') from None
    with contextlib.redirect_stdout(sys.stderr):
        owns = not ray.is_initialized()
        if owns:
            # "local": a fresh instance, not a cluster that `ray start` left running on this machine.
            ray.init(address=options.ray_address or "local", include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING, configure_logging=True)
        try:
            yield
        finally:
            if owns:
                ray.shutdown()


def run_batch_ray(options: BatchOptions, clients: Sequence[EmbeddingClient], *,
                  log: Callable[[str], None] | None = None, clock: Clock = time.monotonic) -> BatchReport:
    """Run (or resume) a job on Ray: the same input, output, rejects and report as ``run_batch``'s local engine.

    ``clients`` name the servers (their URLs, or ``node``) and the call settings each actor copies.

    Raises:
        BatchJobError: Ray is not installed, the job cannot start, or it stopped (what was
            written is kept, and running it again resumes).
    """
    try:
        import ray
        import ray.data
    except ImportError:
        raise BatchJobError('--engine ray needs Ray: pip install "coalesce[ray]"') from None
    def say(line: str) -> None:
        (log or (lambda text: sys.stderr.write(text + "\n")))(line)

    started = clock()
    urls = [c.url for c in clients]
    # The driver reads the model's I/O from the servers it can reach: "node" is each actor's own (and the
    # driver's, where its machine runs a server too).
    reachable = [c for c in clients if c.url != NODE]
    if not reachable:
        try:
            first = clients[0]
            reachable = [EmbeddingClient(url, protocol=first.protocol, model=first.model, timeout_s=first.timeout_s,
                                         retry=first.retry, tls=first.tls, headers=first.headers)
                         for url in resolve_urls(NODE)]
        except ValueError as exc:
            raise BatchJobError(f"{exc}: give the driver a server to read the model's config from (--url)") from None
    io: ModelIO
    io, _ = discover(reachable, say, output=options.output_name, pair=options.pair_column is not None)
    if not options.input_path.is_file():
        raise BatchJobError(f"input {options.input_path} is not a file")
    id_kind = _first_id_kind(options)
    schema = output_schema(io, options.id_column, id_kind)
    resumed = open_work_dir(options, {**job_state(options, io), "id_kind": id_kind, "engine": "ray"})
    directory = options.parts
    done, rejected = finished(directory, options.id_column) if resumed else (set(), set())
    if resumed:
        say(f"coalesce-client: resuming {options.output_path}: {len(done)} rows finished and {len(rejected)} "
            "rejected earlier")
    with ray_session(options):
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = options.progress
        context.verbose_progress = False
        try:
            dataset = _read(options, id_kind)
            if done or rejected:
                dataset = dataset.map_batches(unfinished, batch_format="pyarrow", batch_size=options.ray_batch_rows,
                                              fn_kwargs={"id_column": options.id_column,
                                                         "done": ray.put(done | rejected)})
            # Blocks of one batch each: a single Parquet file (one row group) reads as one block, which one actor
            # would run alone; a lost actor's retry then redoes one batch, not a whole file.
            dataset = dataset.repartition(target_num_rows_per_block=options.ray_batch_rows)
            actors = options.concurrency or max(1, len(urls)) * io.instances
            settings = _client_settings(clients)
            model = settings.pop("model")
            counts = dataset.map_batches(
                PartWritingModel, batch_format="pyarrow", batch_size=options.ray_batch_rows,
                compute=ray.data.ActorPoolStrategy(size=actors),
                # A quarter of a CPU: an actor mostly waits on its server. Not 0, which would let actors onto a node
                # that offers no CPU (a head kept free of work, without a server beside it). Ray Data restarts a lost
                # actor and retries its batch (an actor pool's defaults).
                num_cpus=ACTOR_CPUS,
                fn_constructor_args=(urls, model),
                fn_constructor_kwargs={"directory": str(directory), "schema": schema,
                                       "text_column": options.text_column, "pair_column": options.pair_column,
                                       "id_column": options.id_column, "output_name": io.output,
                                       "cooldown_s": options.cooldown_s,
                                       "tokenizer": str(options.tokenizer) if options.tokenizer else None, **settings})
            send_started = clock()
            sent = written = 0
            for batch in counts.iter_batches(batch_format="pyarrow", batch_size=None):
                written += sum(batch.column("rows").to_pylist())
                sent += sum(batch.column("rows").to_pylist()) + sum(batch.column("rejected").to_pylist())
            send_s = clock() - send_started
        except Exception as exc:
            if isinstance(exc, BatchJobError):
                raise
            raise BatchJobError(f"the Ray job stopped: {type(exc).__name__}: {exc}; the rows written are kept in "
                                f"{directory}: run the job again to resume") from exc
    merge_started = clock()
    output = OutputFile(options.output_path, schema)
    seen: set[Any] = set()
    duplicates = 0
    try:
        for part in part_files(directory):
            table = pq.ParquetFile(part).read()
            ids = table.column(0).to_pylist()
            keep = [row_id not in seen for row_id in ids]
            duplicates += keep.count(False)
            seen.update(ids)
            output.write(table.filter(pa.array(keep, type=pa.bool_())) if not all(keep) else table)
        records = _rejects(directory)
        options.rejects.parent.mkdir(parents=True, exist_ok=True)
        with open(options.rejects, "w", encoding="utf-8") as stream:
            for record in records:
                stream.write(json.dumps(record, ensure_ascii=False) + "\n")
        output.commit()
    except BaseException:
        output.discard()
        raise
    for record in records[:MAX_REJECT_MESSAGES]:
        say(f"coalesce-client: id {record.get('id')!r}: {record['reason']}")
    if len(records) > MAX_REJECT_MESSAGES:
        say(f"coalesce-client: {len(records) - MAX_REJECT_MESSAGES} more rejected rows in {options.rejects}")
    if duplicates:
        say(f"coalesce-client: {duplicates} ids were in two part files (the input holds them twice?); kept once")
    if not options.keep_parts:
        shutil.rmtree(directory)
    return BatchReport(output=str(options.output_path), rejects=str(options.rejects), rows=len(seen) + len(records),
                       rejected=len(records), skipped=len(done) + len(rejected), sent=sent, written=written,
                       output_rows=output.rows, requests=0, concurrency=actors, concurrency_history=[],
                       read_s=0.0, send_s=send_s, merge_s=clock() - merge_started, wall_s=clock() - started,
                       servers=[{"url": url} for url in urls])
