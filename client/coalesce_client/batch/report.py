"""What a run tells its user: the report, the progress bar, the rejects file and its messages."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from coalesce_client.batch.inputs import Reject
from coalesce_client.batch.state import SERVER_REJECTS_FILE

#: Most reject messages printed; the rejects file has every one.
MAX_REJECT_MESSAGES: Final = 20


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



class Progress:
    """A tqdm bar on standard error (rows, rows/s, ETA), or nothing."""

    def __init__(self, enabled: bool, total: int, initial: int) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="row", dynamic_ncols=True,
                            smoothing=0.05, file=sys.stderr, desc="batch")

    def update(self, rows: int, concurrency: int) -> None:
        """Count ``rows`` more done; show the concurrency beside the rate."""
        if self.bar is not None:
            self.bar.update(rows)
            self.bar.set_postfix_str(f"c={concurrency}", refresh=False)

    def write(self, line: str) -> None:
        """Print a message above the bar (or to standard error without one)."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            sys.stderr.write(line + "\n")

    def close(self) -> None:
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()


class RejectsFile:
    """The rejects file of this run, the server's refusals kept in the working folder too, and their messages."""

    def __init__(self, path: Path, directory: Path, noun: str, log: Callable[[str], None]) -> None:
        self.path, self.noun, self._log = path, noun, log
        path.parent.mkdir(parents=True, exist_ok=True)
        self._stream = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self._server = open(directory / SERVER_REJECTS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self.count = 0

    def add(self, reject: Reject, *, from_server: bool = False) -> None:
        """Write ``reject``; a server's refusal also goes to the working folder, so a rerun does not send it again."""
        line = json.dumps(reject.as_dict(), ensure_ascii=False) + "\n"
        self._stream.write(line)
        if from_server:
            self._server.write(line)
            self._server.flush()
        self.count += 1
        if self.count <= MAX_REJECT_MESSAGES:
            self._log(f"coalesce-client: {reject.message(self.noun)}")

    def close(self) -> None:
        """Say how many rejects went unprinted; close the files."""
        if self.count > MAX_REJECT_MESSAGES:
            self._log(f"coalesce-client: {self.count - MAX_REJECT_MESSAGES} more rejected rows in {self.path}")
        self._stream.close()
        self._server.close()


