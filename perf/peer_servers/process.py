"""A peer server as a subprocess: started in its own session, waited for, always ended."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

#: Lines of a peer's log quoted when it fails to start.
LOG_TAIL_LINES = 25


class PeerStartError(RuntimeError):
    """A peer exited or did not answer its readiness probe in time; the message quotes its log."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``path`` (empty if it does not exist)."""
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def session_members(session_id: int) -> list[int]:
    """Process ids whose session is ``session_id`` (Linux ``/proc``)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # Field 6 of /proc/<pid>/stat, counted after the parenthesised command (which may hold spaces).
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == session_id:
                members.append(int(entry.name))
    return members


class PeerProcess:
    """One peer server process (and everything it starts); a context manager that always ends them.

    The process starts a new session, so every process it spawns (Ray's raylet and actors,
    which put themselves in process groups of their own) shares its session id, and the
    stop ends exactly those: SIGTERM to the leader first (peers shut down cleanly on it),
    then SIGKILL to whatever of the session is left.
    """

    def __init__(self, name: str, command: Sequence[str], *, log_path: Path, ready: Callable[[], bool],
                 cwd: Path | None = None, env: dict[str, str] | None = None, ready_timeout_s: float = 300.0,
                 stop_timeout_s: float = 30.0) -> None:
        """Prepare (not start) ``command``; ``ready`` is polled until it returns True."""
        self.name = name
        self.command = list(command)
        self.log_path = log_path
        self.ready = ready
        self.cwd = cwd
        self.env = env
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> PeerProcess:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(self.command, cwd=self.cwd, env=self.env, stdout=self._log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    raise PeerStartError(f"{self.name} exited with {self.process.returncode} before it was ready; "
                                         f"log {self.log_path}:\n{log_tail(self.log_path)}")
                with contextlib.suppress(Exception):
                    if self.ready():
                        return self
                if time.monotonic() > deadline:
                    raise PeerStartError(f"{self.name} not ready after {self.ready_timeout_s:.0f} s; "
                                         f"log {self.log_path}:\n{log_tail(self.log_path)}")
                time.sleep(1.0)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        process = self.process
        if process is not None:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=self.stop_timeout_s)
            # Whatever the leader started and left behind (or all of it, if the leader hung).
            for pid in session_members(process.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            self.process = None
        if self._log is not None:
            self._log.close()
            self._log = None
