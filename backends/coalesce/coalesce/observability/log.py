"""One logging wrapper for the backend.

Inside Triton the adapter installs ``pb_utils.Logger`` as the sink, so messages
land in the server log with the right level; elsewhere they go to ``logging``.
The backend never uses ``print``.
"""

from __future__ import annotations

import logging
from typing import Protocol


class LogSink(Protocol):
    """Where log lines go: ``pb_utils.Logger`` has this shape."""

    def log_info(self, message: str) -> None:
        """Log at INFO."""
        ...

    def log_warn(self, message: str) -> None:
        """Log at WARNING."""
        ...

    def log_error(self, message: str) -> None:
        """Log at ERROR."""
        ...

    def log_verbose(self, message: str) -> None:
        """Log at VERBOSE (Triton's --log-verbose)."""
        ...


class _StdlibSink:
    def __init__(self) -> None:
        self._log = logging.getLogger("coalesce")

    def log_info(self, message: str) -> None:
        self._log.info(message)

    def log_warn(self, message: str) -> None:
        self._log.warning(message)

    def log_error(self, message: str) -> None:
        self._log.error(message)

    def log_verbose(self, message: str) -> None:
        self._log.debug(message)


class Logger:
    """Prefixes every line with ``coalesce[<model>]`` and forwards it to the sink."""

    def __init__(self, model: str, sink: LogSink | None = None) -> None:
        """Log for ``model`` to ``sink`` (the stdlib ``coalesce`` logger if None)."""
        self._prefix = f"coalesce[{model}] "
        self._sink: LogSink = sink if sink is not None else _StdlibSink()

    def info(self, message: str) -> None:
        """Log at INFO."""
        self._sink.log_info(self._prefix + message)

    def warning(self, message: str) -> None:
        """Log at WARNING."""
        self._sink.log_warn(self._prefix + message)

    def error(self, message: str) -> None:
        """Log at ERROR."""
        self._sink.log_error(self._prefix + message)

    def verbose(self, message: str) -> None:
        """Log at VERBOSE."""
        self._sink.log_verbose(self._prefix + message)
