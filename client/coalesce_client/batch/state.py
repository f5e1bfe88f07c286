"""Resuming a job: what makes two runs the same job, the ids already written, the rows refused before."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import pyarrow.parquet as pq

from coalesce_client.batch.inputs import Reject
from coalesce_client.batch.model import ModelIO
from coalesce_client.batch.options import BatchOptions, Id
from coalesce_client.batch.outputs import PART_PREFIX, fsync_replace, part_files
from coalesce_client.errors import (
    BatchJobError,
)

STATE_FILE: Final = "job.json"
SERVER_REJECTS_FILE: Final = "server-rejects.jsonl"
STATE_VERSION: Final = 1


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


def open_work_dir(options: BatchOptions, state: Mapping[str, Any], *, state_file: str = STATE_FILE) -> bool:
    """Prepare the working folder for ``state``; returns whether it holds an earlier run of the same job.

    ``state`` is saved as ``state_file`` in the folder (a job of another engine or format names
    its own) and compared with on the next run.

    Raises:
        BatchJobError: The folder holds another job's parts, or the output exists without them.
    """
    directory = options.parts
    saved_path = directory / state_file
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
    fsync_replace(temporary, saved_path)
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


