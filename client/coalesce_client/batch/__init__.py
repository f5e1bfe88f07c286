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

The package, a concern per file: ``options`` (the job), ``inputs`` (reading rows and their
rejects), ``model`` (what the model takes and returns), ``planning`` (requests and
concurrency), ``endpoints`` (the servers), ``outputs`` (part files and the output file),
``state`` (resuming), ``report`` (what a run says), ``openai`` (OpenAI batch files, through
the engine) and the engines: ``local`` (this process sends every request).
"""

from coalesce_client.batch.endpoints import Endpoint, EndpointPool
from coalesce_client.batch.inputs import (
    RAW_CHARS,
    InputRows,
    Reject,
    clip_raw,
    read_csv,
    read_input,
    read_jsonl,
    read_parquet,
)
from coalesce_client.batch.local import run_batch
from coalesce_client.batch.model import DEFAULT_MAX_REQUEST_BYTES, TRITON_DTYPES, ModelIO, discover, model_io
from coalesce_client.batch.openai import (
    OPENAI_URLS,
    BatchLine,
    ChatSender,
    GatewayUnavailableError,
    LineError,
    OpenAIBatchReport,
    read_batch_file,
    run_openai_batch,
)
from coalesce_client.batch.options import FORMATS, SUFFIX_FORMATS, BatchOptions, Clock, Id
from coalesce_client.batch.outputs import PART_PREFIX, OutputFile, PartWriter, output_schema, part_files
from coalesce_client.batch.planning import ConcurrencySearch, estimate_tokens, plan_requests, row_lengths
from coalesce_client.batch.report import MAX_REJECT_MESSAGES, BatchReport
from coalesce_client.batch.state import (
    SERVER_REJECTS_FILE,
    STATE_FILE,
    finished_ids,
    job_state,
    open_work_dir,
    read_server_rejects,
)

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES", "FORMATS", "MAX_REJECT_MESSAGES", "OPENAI_URLS", "PART_PREFIX", "RAW_CHARS",
    "SERVER_REJECTS_FILE", "STATE_FILE", "SUFFIX_FORMATS", "TRITON_DTYPES", "BatchLine", "BatchOptions", "BatchReport",
    "ChatSender", "Clock", "ConcurrencySearch", "Endpoint", "EndpointPool", "GatewayUnavailableError", "Id",
    "InputRows", "LineError", "ModelIO", "OpenAIBatchReport", "OutputFile", "PartWriter", "Reject", "clip_raw",
    "discover", "estimate_tokens", "finished_ids", "job_state", "model_io", "open_work_dir", "output_schema",
    "part_files", "plan_requests", "read_batch_file", "read_csv", "read_input", "read_jsonl", "read_parquet",
    "read_server_rejects", "row_lengths", "run_batch", "run_openai_batch"
]
