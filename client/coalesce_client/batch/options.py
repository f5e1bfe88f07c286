"""A bulk job's options: what it reads, where it writes, how it sends."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Final

from coalesce_client.errors import (
    BatchJobError,
)

#: Engines that run a job: this process (``local``), or a Ray cluster's actors (``ray``).
ENGINES: Final = ("local", "ray")
#: Input formats, and the file suffixes that name them.
FORMATS: Final = ("jsonl", "csv", "parquet")
SUFFIX_FORMATS: Final = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}

Id = int | str
Clock = Callable[[], float]


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
        engine: ``local`` (this process sends every request) or ``ray`` (Ray Data actors do, on
            the cluster at ``ray_address``; ``pip install "coalesce[ray]"``).
        ray_address: The Ray cluster (``host:port`` of its head, or ``auto``); None: a Ray
            instance started for the job on this machine.
        ray_batch_rows: Rows of one Ray batch: each is sorted by length and cut into requests by
            one actor, and written as one part file (a retried batch rewrites the same file).
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
    engine: str = "local"
    ray_address: str | None = None
    ray_batch_rows: int = 4096

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
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        for name in ("max_concurrency", "part_rows", "ray_batch_rows"):
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


