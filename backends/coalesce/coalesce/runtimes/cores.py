"""Cores shared, not split: a model computes on every core while no other model of the server does.

Each model instance of one server (one stub process each) holds a slot on the server's *core
board*: a small shared-memory file keyed by the server's process id, written without locks
(each stub writes only its own slot; 8-byte aligned stores are atomic). Before a forward pass
an instance marks its slot active and reads everyone else's:

- no other instance is computing: the pass runs on every core (a wide session);
- another one is: it runs on the instance's own share (``intra_op_threads``, one thread in the
  example repository), so the cores go back to a neighbour within one pass.

A row model marks its whole dispatch (reading, tokenising, passes, splitting), a generation
model each step.

The threads a wide pass borrows beyond the instance's share can run at the kernel's idle
priority (``SCHED_IDLE``): they compute only on cores no other thread wants, so a neighbour
that starts mid-pass gets its core at once instead of at this pass's end. A slot whose owner
died is reclaimed by the next instance that claims a slot (its lock is gone), and an active
mark not renewed for ``STALE_AFTER_S`` is ignored, so a crashed stub cannot pin its
neighbours to their share for good.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, TypeVar

import numpy as np

from coalesce.core.errors import ConfigError

#: Instances one board holds; a server with more model instances runs the extra ones on their share.
BOARD_SLOTS: Final = 256
#: int64 words per slot: a 64-byte cache line each, so two stubs never write the same line.
SLOT_WORDS: Final = 8
#: Words of a slot: monotonic ns of the current pass's start (0: not computing), owner pid.
_ACTIVE, _PID = 0, 1
#: An active mark older than this is a stub that died mid-pass (a pass of any example model is far shorter).
STALE_AFTER_S: Final = 30.0
#: Environment variable naming the board file (the launcher sets it per server); else one per parent process.
BOARD_ENV: Final = "COALESCE_CORE_BOARD"
_BOARD_NAME: Final = re.compile(r"coalesce-cores-(\d+)$")
#: Slots held by this process, per board: a process's own fcntl locks never refuse it, so it keeps count.
_HELD: dict[str, set[int]] = {}


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity, as a container's cpuset limits it)."""
    return len(os.sched_getaffinity(0))


def default_board_path() -> Path:
    """The board of this server: ``$COALESCE_CORE_BOARD``, else one per parent process (the tritonserver).

    Triton starts every stub of a server as its child, so the parent's pid names one server's board.
    """
    named = os.environ.get(BOARD_ENV)
    if named:
        return Path(named)
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"coalesce-cores-{os.getppid()}"


def _remove_orphan_boards(directory: Path) -> None:
    """Delete boards whose server is gone (their name carries its pid), so /dev/shm does not fill up."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        match = _BOARD_NAME.match(name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                (directory / name).unlink()
        except PermissionError:
            continue  # another user's server, alive


class CoreBoard:
    """This instance's slot on its server's core board, and the pass-by-pass choice of threads.

    ``own_threads`` is the share a pass gets while another instance computes; ``cores`` what it
    gets while none does.
    """

    def __init__(self, *, own_threads: int, cores: int | None = None, path: Path | None = None) -> None:
        """Claim a free slot on the board at ``path`` (default: this server's), creating the board if needed.

        Raises:
            ConfigError: If the board cannot be created or mapped.
        """
        self.cores = cores if cores is not None else machine_cores()
        self.own_threads = max(1, min(own_threads, self.cores))
        self.path = path if path is not None else default_board_path()
        if path is None and BOARD_ENV not in os.environ:
            _remove_orphan_boards(self.path.parent)
        size = BOARD_SLOTS * SLOT_WORDS * 8
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(self._fd).st_size < size:
                os.ftruncate(self._fd, size)  # every claimant sizes it the same; a race writes the same size
            self._map = mmap.mmap(self._fd, size)
        except OSError as exc:
            raise ConfigError(f"core sharing: cannot open the core board {self.path}: {exc}") from exc
        self._words = np.frombuffer(self._map, dtype=np.int64).reshape(BOARD_SLOTS, SLOT_WORDS)
        self.slot = self._claim()
        self._others = np.ones(BOARD_SLOTS, dtype=bool)
        self._others[self.slot] = False
        self._lock = threading.Lock()
        self._depth = 0

    def _claim(self) -> int:
        """Lock the first free slot's bytes (the lock dies with this process) and clear it."""
        slot_bytes = SLOT_WORDS * 8
        held = _HELD.setdefault(str(self.path), set())
        for slot in range(BOARD_SLOTS):
            if slot in held:
                continue
            try:
                fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, slot_bytes, slot * slot_bytes)
            except OSError:
                continue
            self._words[slot, :] = 0
            self._words[slot, _PID] = os.getpid()
            held.add(slot)
            return slot
        raise ConfigError(f"core sharing: all {BOARD_SLOTS} slots of the core board {self.path} are taken; "
                          "set share_idle_cores false on some models")

    def others_active(self, now_ns: int | None = None) -> int:
        """How many other instances are computing now (marks older than ``STALE_AFTER_S`` not counted)."""
        now_ns = time.monotonic_ns() if now_ns is None else now_ns
        active = self._words[:, _ACTIVE]
        fresh = (active > 0) & (active > now_ns - int(STALE_AFTER_S * 1e9)) & self._others
        return int(np.count_nonzero(fresh))

    def begin(self) -> int:
        """Mark this instance computing; return the threads its pass may use.

        Marks nest: a whole dispatch is marked (its reading, tokenising and splitting are work
        too, and a neighbour that widened in their gaps would crowd the next pass), and each
        pass inside it again; the instance is idle when the outermost mark ends.
        """
        now_ns = time.monotonic_ns()
        with self._lock:
            self._depth += 1
            self._words[self.slot, _ACTIVE] = now_ns  # also renews the mark against STALE_AFTER_S
        return self.cores if self.others_active(now_ns) == 0 else self.own_threads

    def end(self) -> None:
        """End the innermost mark; the instance is idle once none is left."""
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self._words[self.slot, _ACTIVE] = 0

    @contextlib.contextmanager
    def computing(self) -> Iterator[int]:
        """``begin`` ... ``end`` around one pass; yields the threads it may use."""
        threads = self.begin()
        try:
            yield threads
        finally:
            self.end()

    def close(self) -> None:
        """Leave the board (the slot's lock goes with the file descriptor).

        POSIX record locks belong to the process: closing one board of a file releases the locks
        of every board of that file in this process (several models in one process: tests).
        """
        if self._fd < 0:
            return
        self._words[self.slot, _ACTIVE] = 0
        _HELD.get(str(self.path), set()).discard(self.slot)
        del self._words
        self._map.close()
        os.close(self._fd)
        self._fd = -1


def threads_of_this_process() -> set[int]:
    """The kernel thread ids of this process."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def set_idle_priority(thread_ids: set[int]) -> int:
    """Run ``thread_ids`` at ``SCHED_IDLE`` (only on cores nothing else wants); return how many were changed.

    Lowering a thread's own priority needs no privilege; a thread already gone is skipped.
    """
    changed = 0
    for tid in thread_ids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            changed += 1
    return changed


T = TypeVar("T")


def start_borrowed(start: Callable[[], T], priority: str) -> tuple[T, int]:
    """Run ``start`` (it starts the threads a wide pass borrows), lowering them to ``priority``; its result, how many.

    ``priority`` ``idle`` puts the new threads at ``SCHED_IDLE``; anything else leaves them.
    """
    before = threads_of_this_process()
    result = start()
    borrowed = threads_of_this_process() - before
    return result, (set_idle_priority(borrowed) if priority == "idle" else len(borrowed))


def sharing_note(board: CoreBoard, own_threads: int, borrowed: int, priority: str, *, unit: str = "pass") -> str:
    """The load log's line on how a model shares the cores through ``board``."""
    return (f"core sharing: a {unit} runs on {board.cores} cores while no other model computes, else on "
            f"{own_threads}; {borrowed} borrowed threads at {priority} priority; board {board.path} slot {board.slot}")


def open_board(own_threads: int, warn: Callable[[str], None]) -> CoreBoard | None:
    """This instance's place on its server's board, or None (with a warning) where the board cannot be made.

    Sharing is an optimisation: without a board the model runs every pass on its own share.
    """
    try:
        return CoreBoard(own_threads=own_threads)
    except ConfigError as exc:
        warn(f"{exc}; this model runs every pass on intra_op_threads")
        return None


def marked(board: CoreBoard | None) -> contextlib.AbstractContextManager[object]:
    """``board.computing()``, or nothing where the model does not share the cores."""
    return contextlib.nullcontext() if board is None else board.computing()
