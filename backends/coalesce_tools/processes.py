"""The processes of a running server, read from ``/proc``: its Python-backend stubs, their resident memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Final

STUB_PROGRAM: Final = "triton_python_backend_stub"
#: Index of the instance name among a stub's arguments (python_backend ``stub_launcher.cc``).
_STUB_INSTANCE_ARG: Final = 8


@dataclasses.dataclass(frozen=True)
class StubProcess:
    """One Python-backend stub of the server: which model instance it runs, and whether it is dead."""

    pid: int
    model: str
    instance: str
    dead: bool


def stub_processes(server_pid: int, proc: Path = Path("/proc")) -> list[StubProcess]:
    """The stubs among the children of ``server_pid``; a zombie (exited, not yet reaped) counts as dead."""
    found: list[StubProcess] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited between the listing and the read
        # ``pid (comm) state ppid ...``: comm may hold spaces and parentheses, so split after the last ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) < 2 or int(fields[1]) != server_pid:
            continue
        state = fields[0]
        comm = stat[stat.find("(") + 1:stat.rfind(")")]
        if state == "Z":
            # A zombie's cmdline is empty: the stub's comm (truncated to 15 characters) still names it.
            if STUB_PROGRAM.startswith(comm):
                found.append(StubProcess(pid=int(entry.name), model="", instance="", dead=True))
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if not args or not args[0].endswith(STUB_PROGRAM) or len(args) <= _STUB_INSTANCE_ARG:
            continue
        model = Path(args[1]).parent.parent.name  # <repository>/<model>/<version>/model.py
        found.append(StubProcess(pid=int(entry.name), model=model, instance=args[_STUB_INSTANCE_ARG], dead=False))
    return found


def programs_under(folder: Path, proc: Path = Path("/proc")) -> list[int]:
    """Pids of the live processes whose program lies in ``folder`` (a server's stubs outlive it when it is killed)."""
    prefix = str(folder).rstrip("/") + "/"
    found: list[int] = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            program = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        if program.startswith(prefix):
            found.append(int(entry.name))
    return found


def rss_kib(pid: int, proc: Path = Path("/proc")) -> int:
    """Resident memory (``VmRSS``) of ``pid`` in KiB; 0 once it is gone."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0
