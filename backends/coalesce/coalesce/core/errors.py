"""Domain exceptions of the core, each carrying the Triton error code it maps to.

The core raises these; the Triton adapter (``model.py``) maps ``code`` to a
``pb_utils.TritonError`` code in exactly one place, so the core never imports
``triton_python_backend_utils``.
"""

from __future__ import annotations

from typing import ClassVar, TypeVar

_E = TypeVar("_E", bound=BaseException)


class CoalesceError(Exception):
    """Base class of every error the core reports; maps to Triton ``INTERNAL``."""

    code: ClassVar[str] = "INTERNAL"


class InvalidInputError(CoalesceError):
    """A request carried input the model cannot accept (Triton ``INVALID_ARG``)."""

    code: ClassVar[str] = "INVALID_ARG"


class UnavailableError(CoalesceError):
    """The model cannot serve the request right now (Triton ``UNAVAILABLE``)."""

    code: ClassVar[str] = "UNAVAILABLE"


class CancelledError(CoalesceError):
    """The client cancelled the request before it was computed (Triton ``CANCELLED``)."""

    code: ClassVar[str] = "CANCELLED"


class ConfigError(CoalesceError):
    """The model configuration is invalid; raised at load time so the load fails."""

    code: ClassVar[str] = "INVALID_ARG"


class RuntimeFailure(CoalesceError):
    """The inference runtime failed on a sub-batch (Triton ``INTERNAL``)."""

    code: ClassVar[str] = "INTERNAL"


def as_result(error: _E) -> _E:
    """``error`` made fit to be returned as a request's answer rather than raised.

    Drops its traceback and the exception it was raised while handling. A caught
    exception's traceback holds the frames it passed through, and each frame its caller:
    kept in a result, it forms a reference cycle up to ``execute``, whose frame holds the
    ``pb_utils`` requests. Only Python's cycle collector frees that, and in the Python
    backend its next pass may come after the stub has unmapped shared memory at shutdown,
    where destroying those requests crashes the stub (one segfault per stub that ever
    answered a bad request, seen with Triton 2.51).
    """
    error.__traceback__ = None
    error.__context__ = None
    error.__cause__ = None
    return error
