"""The local engine: one process sends a job's requests to one or more servers, with its own resume state."""

from __future__ import annotations

import json
import shutil
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from coalesce_client.batch.endpoints import Endpoint, EndpointPool
from coalesce_client.batch.inputs import InputRows, Reject, clip_raw, read_input
from coalesce_client.batch.model import ModelIO, discover
from coalesce_client.batch.options import BatchOptions, Clock
from coalesce_client.batch.outputs import OutputFile, PartWriter, output_schema
from coalesce_client.batch.planning import ConcurrencySearch, plan_requests, row_lengths
from coalesce_client.batch.report import BatchReport, Progress, RejectsFile
from coalesce_client.batch.state import finished_ids, job_state, open_work_dir, read_server_rejects
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


def object_column(values: Sequence[bytes]) -> np.ndarray:
    """``values`` as a numpy object array (Triton's BYTES), without numpy reading the bytes as a sequence."""
    array = np.empty(len(values), dtype=np.object_)
    array[:] = values
    return array


class _Sender:
    """The sending loop of one run: requests out to the servers, answers into part files, failures handled.

    Only the calling thread touches the job's state; worker threads only send.
    """

    def __init__(self, options: BatchOptions, io: ModelIO, rows: InputRows, pool: EndpointPool,
                 writer: PartWriter, rejects: RejectsFile, progress: Progress, say: Callable[[str], None],
                 clock: Clock) -> None:
        self.options, self.io, self.rows, self.pool = options, io, rows, pool
        self.writer, self.rejects, self.progress, self.say, self.clock = writer, rejects, progress, say, clock
        self.ids = np.array(rows.ids, dtype=object)
        self.texts = object_column(rows.texts)
        self.pairs = object_column(rows.pairs) if rows.pairs is not None else None
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
                                clip_raw(json.dumps(record, ensure_ascii=False)), self.rows.ids[row]), from_server=True)
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

    ``options.engine`` ``ray`` hands the job to ``ray_engine.run_batch_ray``.

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
    if options.engine == "ray":
        from coalesce_client.batch.ray_engine import run_batch_ray

        return run_batch_ray(options, clients, log=log, clock=clock)
    started = clock()
    progress = Progress(False, 0, 0)

    def say(line: str) -> None:
        (log or progress.write)(line)  # beside the progress bar once there is one

    io, clients = discover(clients, say, output=options.output_name, pair=options.pair_column is not None)
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
    progress = Progress(options.progress, total=len(rows), initial=skipped)
    rejects = RejectsFile(options.rejects, directory, rows.noun, say)
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
